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


def test_compiles_inside_the_context_write_their_cache_entry_whatever_jax_would(tmp_path):
    """JAX writes a persistent-cache entry from process 0 only, and only for compiles
    slower than its minimum; inside `cache_entries_from_this_process` every compile of
    this thread writes its entry (a later world's process of any index may need it)."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
        compilation_cache.reset_cache()
        jax.jit(lambda x: x * 3 + 1).lower(jnp.ones(5)).compile()
        assert list(tmp_path.iterdir()) == []  # JAX alone: too fast to be worth writing
        with jax_private.cache_entries_from_this_process():
            jax.jit(lambda x: x * 5 - 2).lower(jnp.ones(5)).compile()
        [entry] = list(tmp_path.iterdir())
        assert entry.name.startswith("jit__lambda-")
        jax.jit(lambda x: x * 7).lower(jnp.ones(5)).compile()  # outside again: JAX's rule
        assert len(list(tmp_path.iterdir())) == 1
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()
