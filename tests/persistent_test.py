"""The persistent tier: plain Orbax, any mesh, last resort, preemption and memory triggers."""

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src.events import read_events
from mnemojax._src.persistent import PersistentTier
from mnemojax.errors import CheckpointMismatchError, CheckpointSaveError, PreemptionExit
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8
REPO = Path(__file__).resolve().parents[1]
STEPS = 7


def _opts(tmp_path, **persistent):
    return h.no_precompile(
        persistent=mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"), **persistent),
        event_log=str(tmp_path / "events.jsonl"))


def test_tier_restores_onto_a_smaller_mesh_exactly(tmp_path):
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(8, 6)).astype(np.float32), np.arange(3, dtype=np.int32)]
    keys = [("model", "w"), ("optimizer", "count")]
    specs = [P(None, "model"), P()]
    big, small = h.mesh_of((4, 2)), h.mesh_of((3, 2), devices=jax.devices()[2:8])
    tier = PersistentTier(str(tmp_path), keys=keys, max_to_keep=2)
    tier.save(4, [jax.device_put(x, NamedSharding(big, s)) for x, s in zip(host, specs,
                                                                            strict=True)],
              wait=True)
    assert tier.latest_step() == 4
    got = tier.restore(4, [NamedSharding(small, s) for s in specs],
                       [(x.shape, x.dtype) for x in host])
    for g, x in zip(got, host, strict=True):
        assert g.sharding.mesh == small
        np.testing.assert_array_equal(np.asarray(g), x)
    tier.close()


def test_a_synchronous_save_that_fails_raises_and_can_be_retried(tmp_path, monkeypatch):
    """``save(wait=True)`` (preemption, memory pressure, the checkpoint before giving up on
    too few processes) raises the failure itself; nothing is left behind."""
    host = [np.ones((8, 6), np.float32), np.arange(3, dtype=np.int32)]
    tier = PersistentTier(str(tmp_path), keys=[("model", "w"), ("optimizer", "count")],
                          max_to_keep=2)
    real_save = tier._manager.save

    def full(step, *args, **kwargs):
        (tmp_path / f"{step}.orbax-checkpoint-tmp-5").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier._manager, "save", full)
    with pytest.raises(CheckpointSaveError, match="step 1") as info:
        tier.save(1, [jax.numpy.asarray(x) for x in host], wait=True)
    assert info.value.steps == (1,) and isinstance(info.value.__cause__, OSError)
    assert tier.take_failures() == [] and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(tier._manager, "save", real_save)
    tier.save(1, [jax.numpy.asarray(x) for x in host], wait=True)  # the same step again
    assert tier.latest_step() == 1
    tier.close()


def test_checkpoint_is_plain_orbax(tmp_path):
    """What the README shows: load a mnemojax checkpoint with orbax.checkpoint alone."""
    import orbax.checkpoint as ocp

    _, step = h.resilient_run(h.make_batches(3), mesh=h.mesh_of((4, 2)),
                              options=_opts(tmp_path, every_steps=3))
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("state", "mnemojax"))
    assert mngr.latest_step() == 3
    restored = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    kernel = restored["state"]["model"]["l1"]["kernel"]
    assert kernel.shape == (h.DIN, h.DHIDDEN)
    assert int(restored["state"]["optimizer"]["step"]) == 3


def test_all_in_memory_copies_lost_falls_back_to_orbax(tmp_path):
    """(1, 8) without snapshots: the lost shards exist nowhere in memory. The checkpoint
    of step 3 is restored and steps 4 and 5 replayed: same final state as the reference."""
    opts = h.no_precompile(
        snapshot=mnemojax.SnapshotOptions(every_steps=0, unreplicated_every_steps=0),
        persistent=mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"),
                                              every_steps=3))
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)), options=opts,
                                faults=FaultInjector().lose_devices(6, [2]))
    h.assert_same_run(got, h.reference_run(h.make_batches(STEPS)))
    [rec] = step.statistics.recoveries
    assert rec.source == "persistent" and rec.source_step == 3 and rec.steps_lost == 2


def test_a_fresh_run_in_an_earlier_runs_directory_is_told_its_steps_are_not_written(
        tmp_path):
    """Run A leaves checkpoint 4; run B starts fresh (no restore) in the same directory.
    Orbax writes no step at or below 4 and said so only by returning False: B's
    checkpoint of step 2 was silently not written (a user trial; a preemption then said
    "checkpointed"). Now B's next call raises `CheckpointSaveError` naming the
    directory's step and what to do, once; a call again continues, and A's checkpoint is
    untouched. A run that restores writes on from there."""
    import orbax.checkpoint as ocp

    batches = h.make_batches(5)
    opts = _opts(tmp_path, every_steps=2)
    h.resilient_run(batches[:4], mesh=h.mesh_of((4, 2)), options=opts)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts)
    try:
        step(model, optimizer, batches[0])
        step(model, optimizer, batches[1])  # its checkpoint of step 2 is refused
        with pytest.raises(CheckpointSaveError, match=r"holds step 4 of an earlier run.*"
                           r"step.restore"):
            step(model, optimizer, batches[2])
        step(model, optimizer, batches[2])  # the run goes on; step 4 is not refused again
        step(model, optimizer, batches[3])
    finally:
        step.close()
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("state", "mnemojax"))
    assert list(mngr.all_steps()) == [2, 4]  # (run A's, untouched)
    assert mngr.latest_step() == 4
    model, optimizer = h.make_mlp()
    again = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts)
    try:
        assert again.restore(model, optimizer) == 4
        again(model, optimizer, batches[4])
        again(model, optimizer, batches[4])  # step 6: written
    finally:
        again.close()
    mngr.reload()
    assert mngr.latest_step() == 6


def test_checkpoint_of_another_model_is_refused(tmp_path):
    h.resilient_run(h.make_batches(2), mesh=h.mesh_of((4, 2)),
                    options=_opts(tmp_path, every_steps=2))
    import optax
    from flax import nnx

    from mnemojax.models import MLP

    with nnx.use_eager_sharding(False):
        other = MLP(h.DIN, 2 * h.DHIDDEN, h.DOUT, rngs=nnx.Rngs(0))
        other_opt = nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param)
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                              options=_opts(tmp_path))
    with pytest.raises(CheckpointMismatchError, match="belongs to another model"):
        step.restore(other, other_opt)
    step.close()


def test_memory_pressure_checkpoints_and_keeps_training(tmp_path):
    opts = h.no_precompile(
        persistent=mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"),
                                              memory_check_every_steps=1),
        event_log=str(tmp_path / "events.jsonl"))
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)), options=opts,
                                faults=FaultInjector().memory_pressure(5, fraction=0.97))
    h.assert_same_run(got, h.reference_run(h.make_batches(STEPS)))
    events = list(read_events(tmp_path / "events.jsonl"))
    triggers = [e for e in events if e["kind"] == "preemption"]
    assert triggers and "memory pressure" in triggers[0]["trigger"]
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_save"]
    assert saved == [triggers[0]["step"]] and saved[0] <= 5
    assert step.statistics.jit_checkpoints == 1
    assert {"run_start", "step", "run_end"} <= {e["kind"] for e in events}


def test_preemption_signal_in_process_checkpoints_every_step_then_exits(tmp_path):
    """Two resilient steps (two models) in one process: the notice reaches both; the one
    called first checkpoints its own last step and the other's, then exits."""
    model, optimizer = h.make_mlp()
    other_model, other_opt = h.make_mlp(seed=1)
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                              options=_opts(tmp_path / "a"))
    other = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                               options=_opts(tmp_path / "b"))
    batches = h.make_batches(4)
    for b in batches[:2]:
        step(model, optimizer, b)
    other(other_model, other_opt, batches[0])
    os.kill(os.getpid(), signal.SIGTERM)  # arrives between steps 2 and 3
    with pytest.raises(PreemptionExit) as info:
        step(model, optimizer, batches[2])
    assert info.value.code == 0 and info.value.step == 2  # step 3 never started
    with pytest.raises(PreemptionExit) as info:
        other(other_model, other_opt, batches[1])
    assert info.value.step == 1  # checkpointed by the first exit; not saved again
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    for sub, k, want in (("a", 2, (model, optimizer)), ("b", 1, (other_model, other_opt))):
        fresh, fresh_opt = h.make_mlp()
        again = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                                   options=_opts(tmp_path / sub))
        assert again.restore(fresh, fresh_opt) == k
        for a, b in zip(h.host_state(fresh, fresh_opt), h.host_state(*want), strict=True):
            np.testing.assert_array_equal(a, b)
        again.close()
        saves = [e["step"] for e in read_events(tmp_path / sub / "events.jsonl")
                 if e["kind"] == "checkpoint_save"]
        assert saves == [k]


def _job(tmp_path, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.jobs.mlp_job", "--ckpt", str(tmp_path / "ckpt"),
         "--steps", str(STEPS), "--out", str(out), "--events", str(tmp_path / "ev.jsonl"),
         *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_a_running_job_then_restart_matches_reference(tmp_path):
    first = _job(tmp_path, tmp_path / "unused.npz", "--step-sleep-s", "0.3")
    second = None
    try:
        for line in first.stdout:
            if line.startswith("step 3"):
                first.send_signal(signal.SIGTERM)
                break
        assert first.wait(timeout=120) == 0  # a clean exit
        second = _job(tmp_path, tmp_path / "final.npz")
        out, _ = second.communicate(timeout=180)
        assert second.returncode == 0, out
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    restored = int(out.split("restored ")[1].split()[0])
    assert 3 <= restored < STEPS  # at most the step that was running when SIGTERM came
    final = np.load(tmp_path / "final.npz")
    want = h.reference_run(h.make_batches(STEPS))
    for i, b in enumerate(want.state):
        np.testing.assert_allclose(final[f"arr_{i}"], b, rtol=1e-5, atol=1e-5)


# -- disk full -------------------------------------------------------------------------------
@contextlib.contextmanager
def _tiny_tmpfs(path: Path, size: str = "4m"):
    """A tmpfs of `size` at `path` (skips where mount is not allowed)."""
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the injected case covers it")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=10)


def _fill(directory: Path) -> Path:
    """Fills the file system of `directory`; returns the file that holds the space."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _disk_full_run(tmp_path, ckpt: Path, *, make_full, make_free):
    """Six steps, a checkpoint every two; the disk is full from step 2 until the
    CheckpointSaveError is caught, then freed and the same batch is passed again."""
    batches = h.make_batches(6)
    model, optimizer = h.make_mlp()
    opts = h.no_precompile(persistent=mnemojax.PersistentOptions(
        directory=str(ckpt), every_steps=2, max_to_keep=3),
        event_log=str(tmp_path / "events.jsonl"))
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts)
    errors, losses = [], []
    for i, batch in enumerate(batches, start=1):
        if i == 2:
            make_full()
        while True:
            try:
                losses.append(float(step(model, optimizer, batch)["loss"]))
                break
            except CheckpointSaveError as e:  # before the call did anything
                assert step.step_count == i - 1
                errors.append(e)
                make_free()
    try:
        step.close()
    except CheckpointSaveError as e:
        errors.append(e)
        make_free()
    step.close()  # never a stale error
    return h.Run(losses, h.host_state(model, optimizer)), step, errors


def _failure_free(n: int) -> h.Run:
    """The same steps through mnemojax on the same mesh, no checkpoints: bit-equal."""
    return h.resilient_run(h.make_batches(n), mesh=h.mesh_of((4, 2)))[0]


def _check_consistent(tmp_path, ckpt: Path, got, step, errors):
    h.assert_same_run(got, _failure_free(6), tol=0)
    assert step.step_count == 6
    failed = [s for e in errors for s in e.steps]
    assert len(errors) >= 1 and failed[0] == 2 and len(set(failed)) == len(failed)
    left = sorted(p.name for p in ckpt.iterdir() if p.name != "filler")
    assert all(name.isdigit() for name in left), left  # no temporary directory
    assert not set(failed) & {int(n) for n in left}
    # The newest checkpoint left restores to the failure-free run's state at its step.
    fresh, fresh_opt = h.make_mlp()
    again = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(
        persistent=mnemojax.PersistentOptions(directory=str(ckpt))))
    restored = again.restore(fresh, fresh_opt)
    again.close()
    assert restored == max(int(n) for n in left)
    want = _failure_free(restored).state
    for a, b in zip(h.host_state(fresh, fresh_opt), want, strict=True):
        np.testing.assert_array_equal(a, b)


# Orbax's write tasks may outlive their event loop after a failed write (its internals).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_disk_full_on_a_tiny_tmpfs_keeps_the_run_consistent(tmp_path):
    with _tiny_tmpfs(tmp_path / "disk") as disk:
        ckpt = disk / "ckpt"
        holder: list[Path] = []
        got, step, errors = _disk_full_run(
            tmp_path, ckpt, make_full=lambda: holder.append(_fill(disk)),
            make_free=lambda: [p.unlink() for p in holder if p.exists()])
        _check_consistent(tmp_path, ckpt, got, step, errors)


def test_disk_full_from_orbax_as_an_oserror_keeps_the_run_consistent(tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: Orbax's save raises ENOSPC until the disk is freed,
    leaving its temporary directory behind as a real failed write does."""
    import orbax.checkpoint as ocp

    full = [False]
    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if full[0]:
            (Path(self.directory) / f"{step}.orbax-checkpoint-tmp-77" / "state").mkdir(
                parents=True)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    ckpt = tmp_path / "ckpt"

    def make_free():
        full[0] = False

    got, step, errors = _disk_full_run(tmp_path, ckpt, make_full=lambda: full.__setitem__(0, True),
                                       make_free=make_free)
    _check_consistent(tmp_path, ckpt, got, step, errors)
    assert errors[0].steps == (2,) and isinstance(errors[0].__cause__, OSError)
    assert sorted(p.name for p in ckpt.iterdir()) == ["4", "6"]


def test_a_restored_run_compiles_its_fallback_meshes_ahead_after_its_first_step(tmp_path):
    """Its first step is not step 1, where a fresh run schedules the candidates: a run
    restored from a checkpoint (or a process that joined a running job) schedules them after
    its first step instead, so a fault soon after a restart does not compile on the
    recovery path."""
    ckpt = mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"), every_steps=1)
    model, optimizer = h.make_mlp()
    first = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                               options=h.no_precompile(persistent=ckpt))
    batches = h.make_batches(3)
    for b in batches[:2]:
        first(model, optimizer, b)
    first.close()
    again = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                               options=mnemojax.ResilienceOptions(
                                   persistent=ckpt, compile=mnemojax.CompileOptions(
                                       cache_dir=None, max_precompiled=1)))
    try:
        fresh, fresh_opt = h.make_mlp()
        assert again.restore(fresh, fresh_opt) == 2
        again(fresh, fresh_opt, batches[2])
        assert again.wait_precompiled(timeout_s=120)
        assert again.statistics.precompiled_meshes == 1
    finally:
        again.close()


def test_a_save_lost_with_a_peer_is_told_apart_from_one_that_failed():
    """`lost_to_a_peer`: the error, or one it was raised from or during (Orbax raises a
    commit thread's error again from its own), is a `CheckpointLostError` or a collective's
    ``JaxRuntimeError``: logged, not raised (the step recovers the world). A full disk is
    raised."""
    from mnemojax._src.persistent import lost_to_a_peer
    from mnemojax.errors import CheckpointLostError

    def chained(outer: BaseException, inner: BaseException, *, cause: bool) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as e:
                if cause:
                    raise outer from e
                raise outer  # noqa: B904 - Orbax raises during the handling, as here
        except BaseException as e:  # noqa: BLE001
            return e

    assert lost_to_a_peer(CheckpointLostError("barrier k: a peer process died"))
    assert lost_to_a_peer(jax.errors.JaxRuntimeError("UNKNOWN: gloo: connection closed"))
    assert lost_to_a_peer(chained(RuntimeError("finalize failed"), CheckpointLostError("x"),
                                  cause=False))
    assert lost_to_a_peer(chained(ValueError("save"), CheckpointLostError("x"), cause=True))
    assert not lost_to_a_peer(OSError(28, "No space left on device"))
    assert not lost_to_a_peer(chained(RuntimeError("finalize"), OSError(28, "full"),
                                      cause=False))


def test_orbax_logs_a_commit_lost_to_a_peer_in_one_line(monkeypatch, caplog):
    """Under a distributed client, `checkpoint_barrier` quiets Orbax's error records of a
    commit it gave up: each keeps its message and says in one line what was raised and the
    CheckpointLostError it came from, without the traceback. Orbax's other errors, and
    anyone else's records (even raised while handling a lost checkpoint), keep theirs."""
    import logging
    import sys

    from absl import logging as absl_logging

    from mnemojax._src.distributed import jax_private
    from mnemojax._src.persistent import _ONE_LINE, checkpoint_barrier
    from mnemojax.errors import CheckpointLostError

    class Client:  # a distributed client (the barrier is not called here)
        pass

    def raised(outer: BaseException | None, inner: BaseException):
        try:
            try:
                raise inner
            except BaseException:
                if outer is None:
                    raise
                raise outer  # noqa: B904 - Orbax's finalize thread raises during the handling
        except BaseException:  # noqa: BLE001
            return sys.exc_info()

    lost = CheckpointLostError("barrier _async_write_complete.3: a peer process died")
    orbax = "/venv/site-packages/orbax/checkpoint/_src/checkpointers/async_checkpointer.py"
    logger = absl_logging.get_absl_logger()

    def log(path, msg, exc_info):
        logger.handle(logger.makeRecord("absl", logging.ERROR, path, 1, msg, (), exc_info))

    monkeypatch.setattr(jax_private.global_state(), "client", Client())
    checkpoint_barrier()
    try:
        caplog.set_level(logging.ERROR, logger="absl")
        log(orbax, "Failed to run 4 Handler Commit operations", raised(None, lost))
        log(orbax, "Save Finalize thread failed.",
            raised(RuntimeError("finalize"), CheckpointLostError("barrier k: died")))
        log(orbax, "Failed to write", raised(None, OSError(28, "No space left on device")))
        log(__file__, "cleanup failed", raised(KeyError("state"), lost))  # not Orbax's
        one, two, full, other = [r for r in caplog.records if r.name == "absl"]
        assert one.exc_info is None and one.getMessage() == (
            "Failed to run 4 Handler Commit operations (CheckpointLostError: barrier "
            "_async_write_complete.3: a peer process died)")
        assert two.exc_info is None and two.getMessage() == (
            "Save Finalize thread failed. (RuntimeError: finalize; from CheckpointLostError: "
            "barrier k: died)")
        assert full.exc_info is not None and full.getMessage() == "Failed to write"
        assert other.exc_info is not None and other.getMessage() == "cleanup failed"
        assert type(logger) is absl_logging.ABSLLogger
    finally:
        logger.removeFilter(_ONE_LINE)
