"""`distributed.auth`: the job secret and the handshake's proofs."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed import auth
from mnemojax._src.errors import WorldConfigError


def test_the_secret_travels_in_the_environment():
    secret = auth.new_secret()
    assert len(secret) == auth.SECRET_BYTES and secret != auth.new_secret()
    assert auth.secret_from_env(auth.secret_env(secret)) == secret
    assert auth.secret_from_env({}) is None
    with pytest.raises(WorldConfigError, match="hex"):
        auth.secret_from_env({auth.JOB_SECRET: "not hex"})
    with pytest.raises(WorldConfigError, match="at least 16 bytes"):
        auth.secret_from_env({auth.JOB_SECRET: "abcd"})


def test_a_proof_binds_the_secret_the_role_and_both_nonces():
    k, ns, nc = b"k" * 32, auth.new_nonce(), auth.new_nonce()
    mac = auth.proof(k, "client", ns, nc)
    assert auth.verify(k, "client", ns, nc, mac)
    assert not auth.verify(k, "server", ns, nc, mac)  # a reflected proof
    assert not auth.verify(b"j" * 32, "client", ns, nc, mac)
    assert not auth.verify(k, "client", auth.new_nonce(), nc, mac)  # a replayed one
    assert not auth.verify(k, "client", ns, nc, "\u00e9" * 64)  # non-ASCII: no TypeError
