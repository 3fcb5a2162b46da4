"""`distributed.jax_private`: fails loudly when JAX changes the private APIs used."""

from __future__ import annotations

import inspect
import os

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


def test_two_processes_share_one_cache_entry_and_either_loads_the_others(tmp_path):
    """Two processes × 2 CPU devices (`tests.jobs.shared_cache_keys`). As JAX computes it,
    the persistent-cache key of one program over all 4 devices differs between the
    processes (one entry each); inside `cache_entries_from_this_process` it is the same.
    An entry process 0 wrote is loaded by process 1, and the program (a reduction across
    both) computes what numpy does. Entries are whole: no partial file is left. A program
    process 0 claimed to compile (`coordination.OneCompile`, as a new world's step on one
    host): process 1 misses, waits, and loads process 0's entry."""
    import json

    from tests import helpers

    cache = tmp_path / "cache"
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    helpers.run_two_processes("tests.jobs.shared_cache_keys", str(cache), str(tmp_path))
    p0, p1 = (json.loads(o.read_text()) for o in outs)
    assert p0["plain_key"] != p1["plain_key"]  # JAX's own keys: one per process
    assert p0["shared_key"] == p1["shared_key"] and p0["g_key"] == p1["g_key"]
    assert (p0["g_hit"], p1["g_hit"]) == (False, True)  # process 1 loaded process 0's entry
    assert (p0["h_claimed"], p1["h_claimed"]) == (True, False)
    assert (p0["h_reads"], p1["h_reads"]) == ([False], [False, True])  # one compile
    assert max(p0["max_error"], p1["max_error"]) < 1e-5
    names = sorted(os.listdir(cache))
    assert not [n for n in names if n.endswith(".part")], names
    assert len([n for n in names if n.startswith("jit_g-")]) == 1, names
    assert len([n for n in names if n.startswith("jit_h-")]) == 1, names


def test_cache_entries_are_renamed_into_place_whole(tmp_path, monkeypatch):
    """`_install_atomic_put`: an entry is written to a file of its own, then renamed to
    its name (never half-written under it); an entry already there is kept."""
    from jax._src import lru_cache

    jax_private._install_atomic_put()
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((os.path.basename(src), os.path.basename(dst)))
        with open(src, "rb") as f:
            assert not os.path.exists(dst) and f.read() == b"whole entry"
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("k", b"whole entry")
    cache.put("k", b"another")  # the first stays
    assert cache.get("k") == b"whole entry"
    assert sorted(os.listdir(tmp_path)) == ["k-cache"]
    assert len(renames) == 1 and renames[0][1] == "k-cache" and renames[0][0].endswith(".part")


def test_the_shared_key_holds_the_hosts_cpu(tmp_path, monkeypatch):
    """XLA:CPU compiles for the host's instruction set: two hosts of other CPUs sharing a
    cache directory must not share an entry, so the shared key hashes the host's CPU
    (`_host_cpu`) where JAX's fingerprint held it."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache, compiler

    keys: list[str] = []
    read = compiler._cache_read

    def recording_read(module_name, cache_key, *args, **kwargs):
        keys.append(cache_key)
        return read(module_name, cache_key, *args, **kwargs)

    monkeypatch.setattr(compiler, "_cache_read", recording_read)
    before = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        compilation_cache.reset_cache()
        for cpu in ("vendor:model:avx512f", "vendor:model:avx2", "vendor:model:avx512f"):
            monkeypatch.setattr(jax_private, "_host_cpu", lambda cpu=cpu: cpu)
            jax.clear_caches()
            with jax_private.cache_entries_from_this_process():
                jax.jit(lambda x: x * 3 + 1).lower(jnp.ones(5)).compile()
        mine = [k for k in keys if k.startswith("jit__lambda-")]
        assert len(mine) == 3 and mine[0] != mine[1] and mine[0] == mine[2], mine
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def test_host_callbacks_are_told_from_a_lowered_computation():
    """`has_host_callbacks` reads a private field of JAX's lowering: a step with
    `jax.debug.print` has them (JAX writes no cache entry for it), a plain one has none."""
    import jax
    import jax.numpy as jnp

    def printing(x):
        jax.debug.print("{}", x.sum())
        return x * 2

    assert jax_private.has_host_callbacks(jax.jit(printing).lower(jnp.ones(3))) is True
    assert jax_private.has_host_callbacks(jax.jit(lambda x: x * 2).lower(jnp.ones(3))) is False
