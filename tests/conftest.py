"""Test setup: 8 virtual CPU devices, configured once before any backend is used."""

import os

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
# Tests compile small programs; keep them out of the user's persistent cache.
os.environ.setdefault("MNEMOJAX_TEST", "1")


def pytest_collection_modifyitems(config, items):
    del config
    if len(jax.devices()) < 8:
        skip = pytest.mark.skip(reason=f"needs 8 devices, have {len(jax.devices())}")
        for item in items:
            if "needs8" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(autouse=True)
def _no_etcd_tls_from_the_shell(monkeypatch):
    """The etcd TLS files come from the environment (`EtcdTLS.from_env`): ones exported in
    the developer's shell would turn every plain ``etcd://`` test into a TLS error. A test
    that wants them sets them itself."""
    from mnemojax._src.distributed.launcher.etcd_store import TLS_ENV

    for var in TLS_ENV.values():
        monkeypatch.delenv(var, raising=False)
