"""`distributed.jax_private`: fails loudly when JAX changes the private APIs used."""

from __future__ import annotations

import inspect

import pytest

from mnemojax._src.distributed import jax_private
from mnemojax._src.errors import UnsupportedJaxVersionError


def test_private_jax_api_shape_is_what_coordination_relies_on():
    jax_private.check_jax_version()
    jax_private.check_private_api()
    from jax._src.lib import _jax
    doc = _jax.get_distributed_runtime_service.__doc__
    assert "recoverable: bool | None" in doc, doc
    doc = _jax.get_distributed_runtime_client.__doc__
    for param in ("init_timeout", "heartbeat_timeout", "shutdown_timeout", "use_compression"):
        assert f"{param}:" in doc, doc
    assert "timeout_in_ms" in _jax.DistributedRuntimeClient.wait_at_barrier.__doc__
    import jax.extend.backend
    assert callable(jax.extend.backend.clear_backends)
    from jax._src import xla_bridge
    src = inspect.getsource(xla_bridge.make_cpu_client)
    # Gloo collectives and the CPU client read these fields of global_state.
    for field in ("global_state.client", "global_state.process_id", "global_state.num_processes"):
        assert field in src, field


@pytest.mark.parametrize("version", ["0.9.9", "0.11.0", "1.0.0"])
def test_unsupported_jax_version_is_typed(version):
    with pytest.raises(UnsupportedJaxVersionError) as e:
        jax_private.check_jax_version(version)
    assert e.value.version == version and "0.11" in e.value.supported


def test_supported_versions_pass():
    for v in ("0.10.0", "0.10.2", "0.10.9.dev20261201"):
        jax_private.check_jax_version(v)
