"""The in-process runs of the bench: (a) no snapshots, (b) every-step snapshots, (c) faults.

(a) and (b) are failure-free and interleaved in blocks of steps (the order alternating
per round) so that both see the same machine noise; the steady-state overhead is (b)/(a)
of the median, over blocks, of the mean step time per block, step 1 (compile) excluded.
Each run's event log is on the run's own clock: time spent in the other run's blocks (and,
in (c), waiting for background compiles) is left out, so every log reads as a standalone
run. The waits are reported apart.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path

from mnemojax._src.bench.config import BenchConfig
from mnemojax._src.events import EventLog
from mnemojax._src.timing import interleaved_block_means

log = logging.getLogger("mnemojax")

RUN_A = "a_no_snapshots"
RUN_B = "b_snapshots"
RUN_C = "c_mnemojax_faults"


class RunClock:
    """A run's event log and its own clock (wall time minus the pauses)."""

    def __init__(self, events_path: str | Path, run: str, **config):
        self.name = run
        self.log = EventLog(events_path, run)
        self._paused = 0.0
        self._pause_start: float | None = None
        self.t0 = time.time()
        self.log.emit("run_start", time_s=self.t0, clock="own", **config)
        self.timeline: list[tuple[float, int]] = []
        self.step_times: list[float] = []

    def now(self) -> float:
        return time.time() - self._paused

    def pause(self) -> None:
        self._pause_start = time.time()

    def resume(self) -> float:
        if self._pause_start is None:
            raise RuntimeError("RunClock.resume() before pause()")
        gap = time.time() - self._pause_start
        self._paused += gap
        return gap

    def step(self, step: int, end: float, duration_s: float, **fields) -> None:
        self.log.emit("step", step=step, time_s=end, duration_s=duration_s, **fields)
        self.timeline.append((end - self.t0, step))
        self.step_times.append(duration_s)


def reset_peak_rss() -> None:
    """Resets this process's VmHWM (Linux >= 4.0); a no-op where unsupported."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak RSS since the last `reset_peak_rss` (VmHWM), else since process start."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(cfg: BenchConfig, mesh, snapshot, *, precompile: bool, cache_dir, injector=None):
    import mnemojax
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    t0 = time.perf_counter()
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    init_s = time.perf_counter() - t0
    options = mnemojax.ResilienceOptions(
        snapshot=snapshot,
        compile=mnemojax.CompileOptions(precompile=precompile, cache_dir=cache_dir,
                                        max_precompiled=cfg.max_precompiled))
    step = mnemojax.resilient(lm_train_step, mesh=mesh, options=options,
                              fault_injector=injector)
    return model, optimizer, step, init_s


def _compiled_s(step, *, ahead: bool) -> list[tuple[tuple[int, ...], float]]:
    """(device ids, lower + compile seconds) of the step's executables compiled ahead or not.

    Reads the compiler of the step's runtime (our own package; no public statistic has it
    yet). Nothing is found before the first call builds the runtime.
    """
    built = getattr(step, "_built", None)
    compiler = getattr(getattr(built, "runtime", None), "compiler", None)
    ready = getattr(compiler, "_ready", {}) if compiler is not None else {}
    return [(tuple(int(d.id) for d in exe.mesh.devices.flat), exe.lower_s + exe.compile_s)
            for exe in list(ready.values()) if exe.ahead_of_time == ahead]


def _first_step(clock: RunClock, step, model, optimizer, batch, init_s: float) -> float:
    clock.log.emit("startup", time_s=clock.now(), duration_s=init_s, phase="init")
    start = clock.now()
    loss = float(step(model, optimizer, batch)["loss"])
    end = clock.now()
    compile_s = sum(s for _, s in _compiled_s(step, ahead=False))
    clock.log.emit("startup", time_s=start + compile_s, duration_s=compile_s, phase="compile")
    clock.step(1, end, max(end - start - compile_s, 0.0), loss=loss)
    return loss


def failure_free_pair(cfg: BenchConfig, mesh, batches, events_path, *, cache_dir,
                      progress: bool = False) -> dict[str, dict]:
    """Runs (a) and (b), interleaved by blocks; returns both results keyed by run name."""
    from flax import nnx

    import mnemojax
    from mnemojax._src.demo import _host_leaves

    snaps = {RUN_A: mnemojax.SnapshotOptions(every_steps=0, unreplicated_every_steps=0),
             RUN_B: mnemojax.SnapshotOptions(every_steps=1, unreplicated_every_steps=1)}
    reset_peak_rss()
    runs = {}
    for name, snap in snaps.items():
        clock = RunClock(events_path, name, mode=name, steps=cfg.steps, snapshot_every_steps=
                         snap.every_steps)
        model, optimizer, step, init_s = _build(cfg, mesh, snap, precompile=False,
                                                cache_dir=cache_dir)
        runs[name] = {"clock": clock, "model": model, "optimizer": optimizer, "step": step,
                      "losses": [_first_step(clock, step, model, optimizer, batches[0], init_s)]}
        clock.pause()
    blocks = [list(range(i, min(i + cfg.block_steps, cfg.steps)))
              for i in range(1, cfg.steps, cfg.block_steps)]

    def run_block(name: str, r: int) -> int:
        run = runs[name]
        clock, step = run["clock"], run["step"]
        clock.resume()
        for i in blocks[r]:
            start = clock.now()
            run["losses"].append(float(step(run["model"], run["optimizer"],
                                            batches[i])["loss"]))
            end = clock.now()
            clock.step(i + 1, end, end - start, loss=run["losses"][-1])
        step.wait_snapshots()  # a copy still in flight belongs to this block
        clock.pause()
        return len(blocks[r])

    def report_progress(r: int) -> None:
        if progress:
            print(f"  (a)+(b) block {r + 1}/{len(blocks)}", file=sys.stderr, flush=True)

    means = interleaved_block_means(list(runs), len(blocks), run_block,
                                    after_round=report_progress)
    for name, run in runs.items():
        run["block_means_s"] = means[name]
    peak = peak_rss_bytes()
    out = {}
    for name, run in runs.items():
        clock, step = run["clock"], run["step"]
        clock.resume()
        stats = step.statistics
        step.close()
        _end_log(clock, stats, cfg.steps)
        out[name] = {
            "wall_s": clock.now() - clock.t0,
            "timeline": clock.timeline,
            "step_times_s": clock.step_times,
            "block_means_s": run["block_means_s"],
            "steady_step_s": statistics.median(run["block_means_s"]),
            "losses": run["losses"],
            "snapshot_bytes": stats.snapshot_bytes,
            "snapshots_taken": stats.snapshots_taken,
            "snapshot_copy_median_s": stats.snapshot_copy_median_s,
            "peak_rss_bytes": peak,
            "final_state": _host_leaves(nnx.state((run["model"], run["optimizer"]))),
        }
    return out


def run_with_faults(cfg: BenchConfig, mesh, batches, events_path, *, cache_dir,
                    progress: bool = False) -> dict:
    """Runs (c): every-step snapshots, precompile on, the preset's device losses."""
    from flax import nnx

    import mnemojax
    from mnemojax._src.demo import _host_leaves

    injector = mnemojax.testing.FaultInjector()
    for f in cfg.faults:
        injector.lose_devices(f.step, list(f.devices), surface=f.surface)
    reset_peak_rss()
    clock = RunClock(events_path, RUN_C, mode=RUN_C, steps=cfg.steps, snapshot_every_steps=1,
                     faults=[{"step": f.step, "devices": list(f.devices),
                              "surface": f.surface} for f in cfg.faults])
    model, optimizer, step, init_s = _build(
        cfg, mesh, mnemojax.SnapshotOptions(every_steps=1, unreplicated_every_steps=1),
        precompile=True, cache_dir=cache_dir, injector=injector)
    losses = [_first_step(clock, step, model, optimizer, batches[0], init_s)]
    waits = [_wait_precompiled(clock, step, "after step 1")]
    faults_at, calls = [], {}
    for i in range(1, cfg.steps):
        n_before = len(step.statistics.recoveries)
        start = clock.now()
        losses.append(float(step(model, optimizer, batches[i])["loss"]))
        end = clock.now()
        new = step.statistics.recoveries[n_before:]
        if not new:
            clock.step(i + 1, end, end - start, loss=losses[-1])
            continue
        calls[new[-1].step] = end - start
        replay_s = _log_recoveries(clock, new, start, end)
        faults_at.append((end - sum(r.total_s for r in new) - clock.t0, i + 1))
        clock.step(i + 1, end, replay_s, loss=losses[-1], after_recovery=True)
        if progress:
            rec = new[-1]
            print(f"  (c) step {i + 1}: recovered in {rec.total_s:.3f} s "
                  f"({rec.plan_kind}, executable {rec.executable})", file=sys.stderr, flush=True)
        if cfg.wait_precompile_after_recovery:
            waits.append(_wait_precompiled(clock, step, f"after the recovery in step {i + 1}"))
    step.wait_snapshots()
    stats = step.statistics
    ahead = _compiled_s(step, ahead=True)
    step.close()
    _end_log(clock, stats, cfg.steps)
    by_mesh = dict(ahead)
    used = [by_mesh.get(tuple(r.new_mesh_devices), 0.0) for r in stats.recoveries
            if r.executable in ("ready", "waited")]
    return {
        "wall_s": clock.now() - clock.t0,
        "timeline": clock.timeline,
        "faults_at": faults_at,
        "step_times_s": clock.step_times,
        "losses": losses,
        "statistics": stats.as_dict(),
        "recoveries": [_with_call(r.as_dict(), calls) for r in stats.recoveries],
        "precompile_waits": waits,
        "compiled_ahead": {"executables": len(ahead), "seconds": sum(s for _, s in ahead),
                           "used_by_recoveries": len(used),
                           "seconds_kept_off_critical_path": sum(used)},
        "snapshot_bytes": stats.snapshot_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "final_state": _host_leaves(nnx.state((model, optimizer))),
    }


def _with_call(record: dict, calls: dict[int, float]) -> dict:
    """Adds the failed step call's duration: a fault cannot come before the call began, so
    ``call_s`` bounds fault -> next good step from above; ``total_s`` starts only when the
    failure surfaced (``before_surfacing_s`` is the difference)."""
    call_s = calls.get(record["step"], record["total_s"])
    return {**record, "call_s": call_s,
            "before_surfacing_s": max(call_s - record["total_s"], 0.0)}


def _wait_precompiled(clock: RunClock, step, when: str) -> dict:
    clock.pause()
    done = step.wait_precompiled()
    return {"when": when, "seconds": clock.resume(), "all_done": bool(done),
            "precompiled_meshes": step.statistics.precompiled_meshes}


def _log_recoveries(clock: RunClock, records, start: float, end: float) -> float:
    """Emits fault / wasted progress / recovery phases for the records of one call.

    The call's time splits into the failed attempt (wasted) and, per recovery, its phases;
    the replay phase re-runs the lost steps (wasted) and the failed step (productive).
    Returns the productive seconds of the step.
    """
    t = end - sum(r.total_s for r in records)
    clock.log.emit("wasted_progress", step=records[0].step, time_s=t, duration_s=t - start,
                   steps=0, partial_step=True)
    productive = 0.0
    for rec in records:
        clock.log.emit("fault", step=rec.step, time_s=t, failed_devices=rec.failed_devices,
                       classification="device_lost")
        for phase in ("detect", "plan", "reshard", "compile"):
            t += rec.phases_s.get(phase, 0.0)
            clock.log.emit("recovery_phase", step=rec.step, time_s=t,
                           duration_s=rec.phases_s.get(phase, 0.0), phase=phase)
        replay = rec.phases_s.get("replay", 0.0)
        lost = rec.steps_lost
        if lost:
            clock.log.emit("wasted_progress", step=rec.step, time_s=t + replay * lost / (lost + 1),
                           duration_s=replay * lost / (lost + 1), steps=lost)
        productive += replay / (lost + 1)
        t = t + replay
        fields = {k: v for k, v in rec.as_dict().items() if k not in ("step", "total_s")}
        clock.log.emit("recovery", step=rec.step, time_s=t, duration_s=rec.total_s, **fields)
    return productive


def _end_log(clock, stats, steps: int) -> None:
    """Closes a run's event log: the snapshot summary (off the critical path), run_end."""
    clock.log.emit("snapshot", time_s=clock.now(), blocking=False,
                   snapshots_taken=stats.snapshots_taken, nbytes=stats.snapshot_bytes,
                   copy_median_s=stats.snapshot_copy_median_s)
    clock.log.emit("run_end", time_s=clock.now(), step=steps, steps=steps)
    clock.log.close()
