"""Compiles ahead of time in a child process (mnemojax._src.compile_process): the same
executable as a compile in this process, the child at the lowest priority, stopped while
a compile on a recovery's path runs, killed at exit; whatever fails there is compiled on
the thread instead.

Each test uses a compile process of its own (`fresh`), ended by the test.
"""

import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mnemojax._src import compile_process, compiler
from tests import compiler_test as ct

pytestmark = pytest.mark.needs8


@pytest.fixture
def fresh(monkeypatch):
    """A compile process of this test's own as the process-wide one, killed after it."""
    process = compile_process.CompileProcess(len(jax.devices()), nice=19)
    monkeypatch.setattr(compile_process, "_made", [process])
    monkeypatch.setattr(compile_process, "_latest", process)
    yield process
    process.abandon()
    assert process.pid is None


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the state on


def _state(pid: int) -> str:
    return _proc_stat(pid)[0]


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped, within a second (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 1.0
    while _state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) == "T"


def _ends(pid: int) -> bool:
    """Whether `pid` ends within 10 s; killed if not (no process outlives its test)."""
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
        os.kill(pid, signal.SIGKILL)
        return False
    return True


def _nice(pid: int) -> int:
    return int(_proc_stat(pid)[16])  # field 19 of proc(5)


def _outputs(compiler_, plan):
    exe, _ = compiler_.get(plan, ct.BATCH)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    x = rng.standard_normal((12, 8)).astype(np.float32)
    new, metrics, flags = ct._run(exe, w, b, x)
    return [np.asarray(a) for a in (*new, metrics["loss"], flags)]


def test_a_compile_ahead_runs_in_the_child_at_nice_19_and_computes_as_one_compiled_here(fresh):
    plan = ct._plan((3, 2))
    ahead = ct._compiler(child_nice=19, in_child=True)
    here = ct._compiler()
    try:
        ahead.precompile([plan], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120)
        assert ahead.compiled_in_child == 1 and fresh.compiled == 1
        assert fresh.pid is not None and _nice(fresh.pid) == 19
        got, want = _outputs(ahead, plan), _outputs(here, plan)
        assert here.compiled_in_child == 0
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        ahead.close()
        here.close()


def test_a_compile_on_a_recoverys_path_stops_the_child_until_it_is_done(fresh, monkeypatch):
    ahead = ct._compiler(child_nice=19, in_child=True)
    try:
        ahead.precompile([ct._plan((3, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and fresh.pid is not None
        pid = fresh.pid
        seen = []
        original = compiler._compile_lowered

        def compile_lowered(lowered, distributed):
            seen.append(_stopped(pid))
            return original(lowered, distributed)

        monkeypatch.setattr(compiler, "_compile_lowered", compile_lowered)
        _, where = ahead.get(ct._plan((2, 2)), ct.BATCH)  # not compiled ahead: on the path
        assert where == "compiled" and seen == [True]
        assert not _stopped(pid)  # resumed
        with fresh.paused(), fresh.paused():  # nested (two threads' recoveries, say)
            assert _stopped(pid)
        assert not _stopped(pid)
    finally:
        ahead.close()


def test_a_module_the_child_cannot_compile_is_left_to_this_process(fresh, caplog):
    ahead = ct._compiler(child_nice=19, in_child=True)
    try:
        ahead.precompile([ct._plan((3, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120)
        backend = jax.devices()[0].client
        devices = jax.devices()[:2]
        from jax._src.lib import xla_client  # (private: the hook's own arguments)
        options = xla_client.CompileOptions()
        options.num_partitions = 2
        options.device_assignment = xla_client.DeviceAssignment.create(np.array([[0, 1]]))
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            got = fresh.compile(backend, b"not a module", xla_client.DeviceList(tuple(devices)),
                                options)
        assert got is None and "failed to compile" in caplog.text
        assert fresh.ended is None  # the child lives on and compiles the next one
        ahead.precompile([ct._plan((2, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and ahead.compiled_in_child == 2
    finally:
        ahead.close()


def test_a_child_that_dies_is_replaced_up_to_max_starts(fresh, caplog, monkeypatch):
    """A child killed while a compile waits for it leaves that compile to the thread; the
    next compile runs in a new child, until `MAX_STARTS` were started (here 2): then the
    thread compiles from now on. Every executable computes as one compiled here."""
    monkeypatch.setattr(compile_process, "MAX_STARTS", 2)
    killed, again, last = ct._plan((3, 2)), ct._plan((2, 2)), ct._plan((2, 1))
    ahead = ct._compiler(child_nice=19, in_child=True)
    here = ct._compiler()

    def kill_during(plan):
        pid = fresh.pid
        assert pid is not None
        with fresh.paused():  # the request waits in the pipe while the child is killed
            ahead.precompile([plan], ct.BATCH)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            assert ahead.wait_precompiled(timeout_s=120)
        assert fresh.pid is None and _ends(pid)

    try:
        ahead.precompile([ct._plan((4, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and ahead.compiled_in_child == 1
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            kill_during(killed)
            assert ahead.compiled_in_child == 1 and fresh.ended is None
            assert "the next one in a new compile process" in caplog.text
            ahead.precompile([again], ct.BATCH)  # in a second child
            assert ahead.wait_precompiled(timeout_s=120) and ahead.compiled_in_child == 2
            assert fresh.starts == 2
            kill_during(ct._plan((1, 2)))
            assert fresh.ended is not None and "from now on" in caplog.text
        ahead.precompile([last], ct.BATCH)  # on the thread, no third child
        assert ahead.wait_precompiled(timeout_s=120)
        assert ahead.compiled_in_child == 2 and ahead.compiled_ahead == 5
        assert fresh.pid is None and fresh.starts == 2
        for plan in (killed, again, last):
            for a, b in zip(_outputs(ahead, plan), _outputs(here, plan), strict=True):
                np.testing.assert_array_equal(a, b)
    finally:
        ahead.close()
        here.close()


def test_abandon_ends_the_compile_in_flight_at_once(fresh):
    ahead = ct._compiler(child_nice=19, in_child=True)
    try:
        ahead.precompile([ct._plan((4, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120)
        errors = []
        with fresh.paused():
            future = ahead.precompile([ct._plan((3, 2))], ct.BATCH)[0]
            time.sleep(1.0)
            assert not future.done()  # waiting for the stopped child
            t0 = time.perf_counter()
            fresh.abandon()
        try:
            future.result(timeout=30)
        except compile_process.CompileAbandoned as e:
            errors.append(e)
        assert errors and time.perf_counter() - t0 < 10
        assert ahead.compiled_in_child == 1
    finally:
        ahead.close()


_EXIT_SCRIPT = """
import logging, os, signal, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import jax
jax.config.update("jax_num_cpu_devices", 8)
from mnemojax._src import compile_process
from tests import compiler_test as t

compiler = t._compiler(in_child=True)
compiler.precompile([t._plan((4, 2))], t.BATCH)
assert compiler.wait_precompiled(timeout_s=120) and compiler.compiled_in_child == 1
child = compile_process.current()
os.kill(child.pid, signal.SIGSTOP)  # the next compile stays in flight until the exit
compiler.precompile([t._plan((3, 2)), t._plan((2, 2))], t.BATCH)
time.sleep(1.0)
print("CHILD", child.pid, flush=True)
print("EXITING", flush=True)
"""


def test_the_exit_kills_the_child_without_waiting_for_its_compile():
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EXITING" in out.stdout, out.stdout[-2000:]
    pid = int(out.stdout.split("CHILD ")[1].split()[0])
    assert _ends(pid)
    assert "waiting for the compile ahead of time in flight" not in out.stdout
    assert out.stdout.count("compiled step for mesh") == 1  # the one before the pause


def test_the_child_dies_with_its_parent():
    """SIGKILL of the parent (no exit hook runs) ends the child too (PR_SET_PDEATHSIG)."""
    script = _EXIT_SCRIPT.replace('print("EXITING", flush=True)',
                                  'import os, signal; os.kill(os.getpid(), signal.SIGKILL)')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pid = int(out.stdout.split("CHILD ")[1].split()[0])
    assert _ends(pid)


def test_the_options_switch_the_child_off(fresh):
    import mnemojax

    assert mnemojax.CompileOptions().compile_process is True
    assert mnemojax.CompileOptions().compile_process_nice == 0
    with pytest.raises(mnemojax.errors.InvalidOptionError, match="compile_process_nice=20"):
        mnemojax.CompileOptions(compile_process_nice=20)
    ahead = ct._compiler(in_child=False)
    try:
        ahead.precompile([ct._plan((3, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120)
        assert ahead.compiled_in_child == 0 and fresh.pid is None  # never started
    finally:
        ahead.close()


def test_under_jax_distributed_the_child_compiles_for_every_processs_devices(tmp_path):
    """Two processes x 2 CPU devices (`tests.jobs.compile_process_job`): each one's compile
    ahead of a (2, 2) mesh over both processes' devices runs in its child (4 devices of
    its own, the global ids mapped onto them), and computes as its compile in the
    process: the same new state and the same cross-process mean."""
    import json

    from tests import helpers

    helpers.run_two_processes("tests.jobs.compile_process_job", str(tmp_path),
                              timeout_s=240)
    for i in range(2):
        got = json.loads((tmp_path / f"p{i}.json").read_text())
        assert got["devices"] == [0, 1, 2048, 2049]  # (not the child's 0..3)
        assert got["in_child"] == 1 and got["child_devices"] == 4
        assert got["where"] == ["ready", "compiled"] and got["equal"]
        assert abs(got["loss"] - got["want_loss"]) < 1e-5 * max(1.0, abs(got["want_loss"]))


def test_a_second_step_compiles_in_the_child_after_the_first_one_closed(fresh):
    """The child outlives the compile thread that started it (PR_SET_PDEATHSIG fires when
    the starting thread ends: it is started from a thread as long-lived as the process)."""
    first = ct._compiler(child_nice=19, in_child=True)
    first.precompile([ct._plan((4, 2))], ct.BATCH)
    assert first.wait_precompiled(timeout_s=120) and first.compiled_in_child == 1
    pid = fresh.pid
    first.close()  # its compile thread ends
    second = ct._compiler(child_nice=19, in_child=True)
    try:
        second.precompile([ct._plan((3, 2))], ct.BATCH)
        assert second.wait_precompiled(timeout_s=120)
        assert second.compiled_in_child == 1 and fresh.pid == pid and fresh.ended is None
    finally:
        second.close()


def test_a_step_with_another_nice_value_gets_a_child_of_its_own_and_the_idle_one_ends(
        monkeypatch):
    """One child per nice value (XLA's compile threads keep the value their process
    starts with): a second step at another value compiles in a child at its value, the
    first step's idle child ends, and starts again (its value kept) when that step
    compiles next; an ending for that reason is no crash (`MAX_STARTS` 2 here: a crash
    after it still leaves a restart)."""
    monkeypatch.setattr(compile_process, "_made", [])
    monkeypatch.setattr(compile_process, "_latest", None)
    monkeypatch.setattr(compile_process, "MAX_STARTS", 2)
    first = ct._compiler(child_nice=5, in_child=True)
    second = ct._compiler(child_nice=19, in_child=True)
    try:
        first.precompile([ct._plan((4, 2))], ct.BATCH)
        assert first.wait_precompiled(timeout_s=120) and first.compiled_in_child == 1
        low = compile_process.current()
        assert low is not None and low.pid is not None and _nice(low.pid) == 5
        low_pid = low.pid
        second.precompile([ct._plan((3, 2))], ct.BATCH)
        assert second.wait_precompiled(timeout_s=120) and second.compiled_in_child == 1
        high = compile_process.current()
        assert high is not None and high is not low
        assert high.pid is not None and _nice(high.pid) == 19
        assert low.pid is None and _ends(low_pid) and low.ended is None
        first.precompile([ct._plan((2, 2))], ct.BATCH)
        assert first.wait_precompiled(timeout_s=120) and first.compiled_in_child == 2
        assert low.pid is not None and low.pid != low_pid and _nice(low.pid) == 5
        assert high.pid is not None  # (asked for before: both kept)
        crashed = low.pid
        os.kill(crashed, signal.SIGKILL)  # its one crash: compiled on the thread
        assert _ends(crashed)
        first.precompile([ct._plan((2, 1))], ct.BATCH)
        assert first.wait_precompiled(timeout_s=120) and first.compiled_in_child == 2
        assert low.ended is None and low.starts == 2 and low.retired == 1
    finally:
        first.close()
        second.close()
        for process in list(compile_process._made):
            process.abandon()
            assert process.pid is None


def test_a_world_with_fewer_devices_keeps_the_child_and_one_made_in_a_pause_starts_paused(
        monkeypatch):
    """A later world with fewer devices uses the child of its nice value (a new one would
    start cold after a process loss); one with more gets a new one. A compile process made
    while a recovery's compile holds the children paused starts paused, and continues when
    the block ends."""
    monkeypatch.setattr(compile_process, "_made", [])
    monkeypatch.setattr(compile_process, "_latest", None)
    first = compile_process.shared(6, nice=3)
    assert compile_process.shared(4, nice=3) is first
    wider = compile_process.shared(8, nice=3)
    assert wider is not first and wider.num_devices == 8
    try:
        with compile_process.paused():
            late = compile_process.shared(8, nice=4)  # made inside the block
            late.start()
            assert late.pid is not None and _stopped(late.pid)
        assert not _stopped(late.pid)
    finally:
        for process in list(compile_process._made):
            process.abandon()


def test_the_child_ignores_the_terminals_keys(fresh):
    """In this process's session and group (its scheduling group too, where Linux groups
    by session: a session of its own got an equal share of the CPU whatever its nice
    value), so the terminal's Ctrl-C, Ctrl-\\ and Ctrl-Z reach it: it ignores them."""
    ahead = ct._compiler(child_nice=19, in_child=True)
    try:
        ahead.precompile([ct._plan((4, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and fresh.pid is not None
        pid = fresh.pid
        assert os.getpgid(pid) == os.getpgid(0) and os.getsid(pid) == os.getsid(0)
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
            os.kill(pid, sig)
        assert not _stopped(pid)
        ahead.precompile([ct._plan((3, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and ahead.compiled_in_child == 2
    finally:
        ahead.close()


_CACHE_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from mnemojax._src import compile_process
from mnemojax._src.distributed import jax_private
mesh = jax.make_mesh((4, 2), ("d", "m"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
x = jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", "m")))
f = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0))
child = compile_process.CompileProcess(8)
if sys.argv[2] == "write":
    with jax_private.compiles_elsewhere(child.compile):
        c = f.lower(x).compile()
    assert child.compiled == 1
else:
    c = f.lower(x).compile()  # from the entry the other run's child compiled
np.testing.assert_allclose(np.asarray(c(x)), np.tanh(a @ a.T).sum(0), rtol=1e-5)
child.abandon()
print("OK", sys.argv[2], flush=True)
"""


def test_a_cache_entry_of_a_child_compile_runs_in_a_later_process(tmp_path):
    """The entry holds the child's own bytes: the executable loaded from them, serialized
    again, lacks kernels on XLA:CPU ("NOT_FOUND: Function ... not found" in the run that
    loads it)."""
    import os as os_

    env = {**os_.environ, "PYTHONPATH": os_.getcwd()}
    for mode in ("write", "read"):
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(tmp_path), mode],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
        assert out.returncode == 0 and f"OK {mode}" in out.stdout, out.stderr[-2000:]
    assert [n for n in os_.listdir(tmp_path) if n.startswith("jit_")]


_EXIT_TRACING_SCRIPT = """
import logging, sys, threading, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import jax
jax.config.update("jax_num_cpu_devices", 8)
from tests import compiler_test as t
traced = threading.Event()

def slow(leaves, batch):  # the compile ahead is still tracing at the exit
    traced.set()
    time.sleep(2.0)
    return t._pure(leaves, batch)

compiler = t._compiler(slow, in_child=True)
compiler.precompile([t._plan((4, 2))], t.BATCH)
assert traced.wait(60)
print("EXITING", flush=True)
"""


def test_an_exit_during_the_first_trace_starts_no_child_and_compiles_nothing():
    out = subprocess.run([sys.executable, "-c", _EXIT_TRACING_SCRIPT], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EXITING" in out.stdout
    assert "compiles ahead of time run in process" not in out.stdout  # no child started
    assert "compiled step for mesh" not in out.stdout  # nor a compile on the thread


def test_a_compiler_starts_its_child_before_its_first_compile_ahead(fresh):
    """The child's start-up (importing JAX) overlaps the first step's compile
    (`api` starts it when it builds the step), not the first compile ahead."""
    ahead = ct._compiler(child_nice=19, in_child=True)
    off = ct._compiler(in_child=False)
    try:
        off.start_child()
        assert fresh.pid is None
        ahead.start_child()
        assert fresh.pid is not None and fresh.compiled == 0
        pid = fresh.pid
        ahead.precompile([ct._plan((3, 2))], ct.BATCH)
        assert ahead.wait_precompiled(timeout_s=120) and ahead.compiled_in_child == 1
        assert fresh.pid == pid
    finally:
        ahead.close()
        off.close()
