"""The control plane over TLS (issue 12, security): ``etcds://`` talks HTTPS to an etcd
that refuses clients without a certificate from the job's CA (``--client-cert-auth``);
the client's files come from ``MNEMOJAX_ETCD_{CACERT,CERT,KEY}``. Without the
certificate nobody can read the job's keys or write one (declare a worker dead, forge a
world)."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed.launcher.etcd_store import (
    TLS_ENV,
    EtcdStore,
    EtcdTLS,
    RendezvousError,
    parse_rdzv,
)
from mnemojax._src.errors import InvalidOptionError
from tests.etcd_cluster import etcd_cluster


@pytest.fixture(scope="module")
def cluster():
    with etcd_cluster(1, tls=True) as c:
        yield c


def _store(cluster, monkeypatch, *, job: str, client_cert: bool = True, **kw) -> EtcdStore:
    for var in TLS_ENV.values():  # what an earlier store of this test set
        monkeypatch.delenv(var, raising=False)
    for var, path in cluster.tls.env(client_cert=client_cert).items():
        monkeypatch.setenv(var, path)
    return EtcdStore.from_url(cluster.url, job, **kw)


def test_a_client_with_the_jobs_certificate_reads_and_writes(cluster, monkeypatch):
    assert cluster.url.startswith("etcds://")
    store = _store(cluster, monkeypatch, job="tls-ok")
    key = store.key("dead", 3)
    assert store.create(key, {"by": "agent"}) and not store.create(key, {"by": "other"})
    assert store.get(key) == {"by": "agent"} and store.items() == {"dead/3": {"by": "agent"}}


def test_without_a_client_certificate_nothing_is_read_or_written(cluster, monkeypatch):
    """The CA alone (the server is trusted) is not enough: the server wants a client
    certificate. A plain-HTTP client to the same port is refused too."""
    good = _store(cluster, monkeypatch, job="tls-refused")
    good.put(good.key("world", 0), {"members": [0, 1]})
    intruder = _store(cluster, monkeypatch, job="tls-refused", client_cert=False, retry_s=0.5)
    with pytest.raises(RendezvousError, match="no etcd member .* SSLError"):
        intruder.get(intruder.key("world", 0))
    with pytest.raises(RendezvousError):
        intruder.put(intruder.key("dead", 1), {"by": "intruder"})
    plain = EtcdStore(parse_rdzv(cluster.url)[1], "tls-refused", retry_s=0.5)
    with pytest.raises(RendezvousError, match="ConnectionFailedError"):
        plain.put(plain.key("dead", 1), {"by": "intruder"})
    assert good.items() == {"world/0": {"members": [0, 1]}}  # nothing was written


def test_tls_settings_are_checked_by_name_when_made(cluster, tmp_path):
    """Every file is read at once: a wrong one fails by name, not as an unreachable
    cluster after the store's retries."""
    files = cluster.tls
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(InvalidOptionError, match="MNEMOJAX_ETCD_CACERT='/nowhere.pem'"):
        EtcdTLS.from_env({TLS_ENV["cacert"]: "/nowhere.pem"})
    with pytest.raises(InvalidOptionError, match="MNEMOJAX_ETCD_CERT is set but "
                                                 "MNEMOJAX_ETCD_KEY is not"):
        EtcdTLS(cert=files.client_cert)  # also without the environment
    with pytest.raises(InvalidOptionError, match="MNEMOJAX_ETCD_CACERT=.*not a PEM CA"):
        EtcdTLS(cacert=str(junk))
    with pytest.raises(InvalidOptionError, match="MNEMOJAX_ETCD_CERT=.*matching key"):
        EtcdTLS(cert=files.client_cert, key=files.server_key)  # another certificate's key
    assert EtcdTLS.from_env({}) == EtcdTLS() and not EtcdTLS().given
    assert EtcdTLS.from_env(files.env()).given
    with pytest.raises(InvalidOptionError, match="use etcds://"):
        EtcdStore([("127.0.0.1", 1)], "job", tls=EtcdTLS(cacert=files.ca))
    assert parse_rdzv("etcds://h:1,g:2") == ("https", (("h", 1), ("g", 2)))
    assert parse_rdzv("etcd://h:1") == ("http", (("h", 1),))
    with pytest.raises(InvalidOptionError, match="rdzv='https://h:1'"):
        parse_rdzv("https://h:1")


def test_mnemojax_status_reads_the_job_over_tls(cluster, monkeypatch, capsys):
    from mnemojax._src.cli import main

    store = _store(cluster, monkeypatch, job="tls-status")
    store.put(store.key("world", 0), {"members": [0, 1], "coordinator": "10.0.0.1:1",
                                      "host_node": 0})
    assert main(["status", "--rdzv", cluster.url, "--rdzv-id", "tls-status"]) == 0
    assert "world 0, workers [0, 1]" in capsys.readouterr().out
