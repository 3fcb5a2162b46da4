"""The classical baseline's orchestrator: launch the job, see it die, relaunch it.

Plays the role of a cluster scheduler restarting a failed job: it starts
`baseline_worker` as a subprocess, waits for it, and when the process is killed (the
injected fault) starts a new one, which restores the latest Orbax checkpoint and redoes
the steps lost since. Every process has a hard deadline and is killed in a ``finally``.

Recovery of one fault, from the event log: kill (the worker's ``fault`` event) → the
exit seen here (detect) → the next launch (relaunch) → process start + imports → init →
restore → compile → first good step. The steps redone since the checkpoint are wasted
progress, reported apart (and ``back_to_fault_step_s`` is the time until the killed
step is done again).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mnemojax._src.bench.config import BenchConfig
from mnemojax._src.errors import BaselineError
from mnemojax._src.events import EventLog, read_events

log = logging.getLogger("mnemojax")

WORKER_MODULE = "mnemojax._src.bench.baseline_worker"


@dataclasses.dataclass(frozen=True)
class SaveCost:
    """Measured cost of one Orbax checkpoint save of the job's state.

    Attributes:
        first_blocking_s: blocking part of the first save of a process (Orbax sets up).
        blocking_s: median blocking part of the later saves: δ for Young/Daly.
        total_s: median time until a later save was committed (async part included).
        nbytes: bytes of the state saved.
    """

    first_blocking_s: float
    blocking_s: float
    total_s: float
    nbytes: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrate_save_cost(cfg: BenchConfig, mesh, directory: str | os.PathLike) -> SaveCost:
    """Times `cfg.calibration_saves` async Orbax saves of the job's (plain Flax) state.

    Runs in the calling process, on its devices; the state is built exactly as the worker
    builds it. Each save is waited for before the next, so saves do not queue.
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, shard_onto

    shutil.rmtree(directory, ignore_errors=True)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    shard_onto(model, optimizer, mesh)
    state = nnx.state((model, optimizer))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint_max_to_keep,
                                             enable_async_checkpointing=True))
    blocking, total = [], []
    try:
        for i in range(cfg.calibration_saves):
            t0 = time.perf_counter()
            manager.save(i + 1, args=ocp.args.StandardSave(state))
            blocking.append(time.perf_counter() - t0)
            manager.wait_until_finished()
            total.append(time.perf_counter() - t0)
    finally:
        manager.close()
        shutil.rmtree(directory, ignore_errors=True)
    return SaveCost(first_blocking_s=blocking[0], blocking_s=statistics.median(blocking[1:]),
                    total_s=statistics.median(total[1:]), nbytes=nbytes)


def run_baseline(cfg: BenchConfig, *, preset: str, out_dir: str | os.PathLike,
                 events_path: str | os.PathLike, interval_steps: int, run: str = "baseline",
                 compile_cache: str | None = None, final_state: str | None = None,
                 timeout_s: float | None = None) -> dict:
    """Runs the classical job to the end, relaunching it after each injected kill.

    Args:
        cfg: the bench config (its faults' steps are where the process is killed).
        preset: passed to the worker, which loads the same config.
        out_dir: checkpoints go to ``out_dir/baseline_ckpt`` (wiped first), worker
            stderr to ``out_dir/baseline_worker.log``.
        events_path: the JSONL event log (the workers append to it too).
        interval_steps: checkpoint every K steps.
        compile_cache: JAX persistent compilation cache directory for the workers.
        final_state: the last worker writes its final state there (.npz).
        timeout_s: deadline for all processes together (default `cfg.worker_timeout_s`).

    Returns:
        ``launches`` (pid, return code, times), ``recoveries`` (one per kill, phases in
        seconds), ``timeline``, ``wall_s``, ``peak_rss_bytes`` and counters.

    Raises:
        BaselineError: a worker failed other than by the injected kill, or the deadline
            passed (the process is killed first).
    """
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "baseline_ckpt"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    stderr_path = out_dir / "baseline_worker.log"
    deadline = time.monotonic() + (timeout_s or cfg.worker_timeout_s)
    events = EventLog(events_path, run)
    t_start = time.time()
    events.emit("run_start", time_s=t_start, mode="baseline", interval_steps=interval_steps,
                faults=list(cfg.fault_steps), steps=cfg.steps)
    remaining = list(cfg.fault_steps)
    launches: list[dict] = []
    redo_until = 0
    kill_time = None
    try:
        with stderr_path.open("ab") as stderr:
            while True:
                if len(launches) > len(cfg.fault_steps):
                    raise BaselineError("more launches than faults", returncode=None,
                                        stderr_tail=_tail(stderr_path))
                launched_at = time.time()
                if kill_time is not None:
                    events.emit("restart", step=launches[-1]["die_at"], time_s=launched_at,
                                duration_s=launched_at - kill_time,
                                detect_s=launches[-1]["exited_at"] - kill_time,
                                relaunch_s=launched_at - launches[-1]["exited_at"])
                cmd = [sys.executable, "-m", WORKER_MODULE, "--preset", preset,
                       "--ckpt-dir", str(ckpt_dir), "--events", str(events_path),
                       "--run", run, "--interval", str(interval_steps),
                       "--steps", str(cfg.steps), "--die-at", ",".join(map(str, remaining)),
                       "--redo-until", str(redo_until), "--launched-at", repr(launched_at),
                       "--launch", str(len(launches))]
                if compile_cache:
                    cmd += ["--compile-cache", compile_cache]
                if final_state:
                    cmd += ["--final-state", str(final_state)]
                rc, pid, exited_at = _run_once(cmd, stderr, deadline, stderr_path)
                launches.append({"pid": pid, "returncode": rc, "launched_at": launched_at,
                                 "exited_at": exited_at,
                                 "die_at": remaining[0] if remaining else None})
                if rc == 0:
                    break
                if rc != -signal.SIGKILL or not remaining:
                    raise BaselineError(f"baseline worker pid {pid} exited with rc={rc}",
                                        returncode=rc, stderr_tail=_tail(stderr_path))
                fault = _fault_event(events_path, run, pid)
                kill_time = fault["time"]
                redo_until = max(redo_until, fault["step"] - 1)
                log.info("mnemojax bench: baseline pid %d killed at step %d; restarting",
                         pid, fault["step"])
                remaining.pop(0)
        result = summarize_baseline(list(read_events(events_path)), run)
        for rec in result["recoveries"]:  # the killed step's attempt and the lost steps
            events.emit("wasted_progress", step=rec["step"], time_s=t_start + rec["fault_at_s"],
                        duration_s=rec["partial_step_s"], steps=rec["steps_lost"],
                        partial_step=True)
    finally:
        events.close()
    result.update(launches=launches, interval_steps=interval_steps)
    return result


def _run_once(cmd, stderr, deadline, stderr_path) -> tuple[int, int, float]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return rc, proc.pid, time.time()
    except subprocess.TimeoutExpired:
        raise BaselineError(f"baseline worker pid {proc.pid} ran past the deadline",
                            returncode=None, stderr_tail=_tail(stderr_path)) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _fault_event(events_path, run, pid) -> dict:
    for e in read_events(events_path):
        if e.get("run") == run and e["kind"] == "fault" and e.get("pid") == pid:
            return e
    raise BaselineError(f"baseline worker pid {pid} was killed without a fault event",
                        returncode=-signal.SIGKILL, stderr_tail="")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def summarize_baseline(events: list[dict], run: str = "baseline") -> dict:
    """Per-fault recovery phases, timeline and totals of a baseline run, from its events."""
    ev = [e for e in events if e.get("run") == run]
    t0 = next(e["time"] for e in ev if e["kind"] == "run_start")
    by_pid: dict[int, list[dict]] = {}
    for e in ev:
        if e.get("pid") is not None:
            by_pid.setdefault(e["pid"], []).append(e)
    pids = list(by_pid)  # in launch order (events are appended in time order)
    recoveries = []
    for old, new in zip(pids, pids[1:], strict=False):
        fault = next(e for e in by_pid[old] if e["kind"] == "fault")
        restart = next(e for e in ev if e["kind"] == "restart" and e["step"] == fault["step"])
        mine = by_pid[new]
        startup = next(e for e in mine if e["kind"] == "startup" and e["phase"] == "start+init")
        compile_ = next(e for e in mine if e["kind"] == "startup" and e["phase"] == "compile")
        restore = next((e for e in mine if e["kind"] == "checkpoint_restore"), None)
        steps = [e for e in mine if e["kind"] == "step"]
        redo = [e for e in steps if e["replay"]]
        back = next(e for e in steps if e["step"] == fault["step"])
        restored = restore["step"] if restore else 0
        recoveries.append({
            "step": fault["step"], "old_pid": old, "new_pid": new,
            "restored_step": restored,
            "steps_lost": fault["step"] - 1 - restored,
            "phases_s": {
                "detect": restart["detect_s"], "relaunch": restart["relaunch_s"],
                "start+import": startup["process_start_import_s"],
                "init": startup["init_s"],
                "restore": restore["duration_s"] if restore else 0.0,
                "compile": compile_["duration_s"],
                "redo": sum(e["duration_s"] for e in redo),
                "failed_step": back["duration_s"],
            },
            "fault_at_s": fault["time"] - t0,
            "partial_step_s": fault["time"] - fault["step_started_at"],
            "first_step_s": steps[0]["duration_s"],
            "recovery_s": steps[0]["time"] - fault["time"],
            "back_to_fault_step_s": back["time"] - fault["time"],
        })
    steps = [e for e in ev if e["kind"] == "step"]
    saves = [e for e in ev if e["kind"] == "checkpoint_save" and not e.get("drain")]
    end = max(e["time"] for e in ev)
    rss = [e["peak_rss_bytes"] for e in ev if "peak_rss_bytes" in e]
    return {
        "wall_s": end - t0,
        "timeline": [(e["time"] - t0, e["step"]) for e in steps],
        "faults_at": [(e["time"] - t0, e["step"]) for e in ev if e["kind"] == "fault"],
        "step_times_s": [e["duration_s"] for e in steps if not e["replay"]],
        "recoveries": recoveries,
        "pids": pids,
        "checkpoint_saves": len(saves),
        "checkpoint_save_s": [e["duration_s"] for e in saves],
        "checkpoint_restore_s": [e["duration_s"] for e in ev if e["kind"] == "checkpoint_restore"],
        "steps_redone": sum(1 for e in steps if e["replay"]),
        "final_loss": steps[-1]["loss"] if steps else None,
        "peak_rss_bytes": max(rss) if rss else 0,
    }
