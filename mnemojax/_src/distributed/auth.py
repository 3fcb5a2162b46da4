"""The job secret and the proofs of the connection handshake (no JAX, no sockets).

The launcher makes one secret per job (`new_secret`). Agents receive it in their
environment (`JOB_SECRET`), never on a command line (``/proc/<pid>/cmdline`` is
world-readable, ``/proc/<pid>/environ`` is not), and each worker inherits it from its agent.
Every TCP connection between launcher, agents and workers opens with a mutual
challenge-response before any other message (`transport.connect`, `transport.accept_loop`):

    server -> client   AuthChallenge(nonce=ns)
    client -> server   AuthResponse(nonce=nc, mac=HMAC(k, "client" | ns | nc))
    server -> client   AuthAccepted(mac=HMAC(k, "server" | ns | nc)), or it closes

Both nonces are fresh (a recorded exchange cannot be replayed) and the role labels differ
(a proof cannot be reflected back). The client checks the server too: a process that took
over a dead agent's port cannot serve forged snapshots.

Why at connection setup and not a MAC on every message: every connection is loopback TCP,
which an unprivileged local user can neither read nor inject into, so authenticating its
two ends is enough; a MAC over every snapshot payload would cost a SHA-256 pass per step
(payload integrity against accidents is the CRC32C's job). Across hosts, where the network
can be tampered with, the same secret would key TLS or per-message MACs instead.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

from mnemojax._src.errors import WorldConfigError

JOB_SECRET = "MNEMOJAX_JOB_SECRET"  # hex, set by the launcher in each agent's environment
SECRET_BYTES = 32
NONCE_BYTES = 32


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_env(secret: bytes) -> dict[str, str]:
    """The environment entry that hands ``secret`` to a child process."""
    return {JOB_SECRET: secret.hex()}


def secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """The job secret in ``env``, or None when there is none.

    Raises:
        WorldConfigError: it is set but not a hex string of at least 16 bytes.
    """
    raw = env.get(JOB_SECRET)
    if not raw:
        return None
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        raise WorldConfigError(f"{JOB_SECRET} is invalid: expected hex digits") from None
    if len(secret) < 16:
        raise WorldConfigError(f"{JOB_SECRET} is invalid: expected at least 16 bytes, got "
                               f"{len(secret)}")
    return secret


def fingerprint(secret: bytes) -> str:
    """A public name of ``secret`` (HMAC of a fixed label): equal fingerprints mean equal
    secrets, and it reveals nothing usable about the secret."""
    return hmac.new(secret, b"mnemojax-secret-id", hashlib.sha256).hexdigest()[:16]


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: bytes, role: str, server_nonce: str, client_nonce: str) -> str:
    """HMAC-SHA256 of one side (``role``: ``"client"`` or ``"server"``) over both nonces."""
    msg = f"mnemojax-{role}\0{server_nonce}\0{client_nonce}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def verify(secret: bytes, role: str, server_nonce: str, client_nonce: str, mac: str) -> bool:
    """Whether ``mac`` is ``role``'s proof (constant-time comparison)."""
    expected = proof(secret, role, server_nonce, client_nonce).encode()
    return hmac.compare_digest(expected, mac.encode("utf-8", "replace"))
