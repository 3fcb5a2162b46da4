"""The bench's multi-process runs: a real process killed from outside, two ways to go on.

(e) mnemojax: `mp_resilient_worker` under the launcher (`launcher.scenario.run_scenario`,
    the launcher's default options unless the bench config says otherwise), worker
    ``victim`` SIGKILLed once it has published step ``kill_after_step``; the survivors
    agree, re-initialise in-process and replay.
(f) the classical job: `mp_classical_worker` in ``nproc`` processes joined by
    ``jax.distributed`` with async Orbax checkpoints every K steps; the same worker is
    SIGKILLed once it has logged the same step, and the supervisor here (the role of
    torchrun or JobSet) kills the others at once and restarts every process, which
    restore the latest committed checkpoint and redo the lost steps.

Both run the preset's GPT on the preset's mesh over ``nproc`` × ``devices_per_proc`` CPU
devices, with the same batches. Figures, in wall-clock seconds from the kill: to the next
good step (every process of the new world has completed a step the victim never
completed) and back past the killed step (every one has completed that step). Every
process started is ended in a ``finally`` (the launcher's cleanup for (e)).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mnemojax._src.errors import BaselineError
from mnemojax._src.events import read_events

RUN_E = "e_mnemojax_processes"
RUN_F = "f_classical_processes"
RESILIENT_WORKER = "mnemojax._src.bench.mp_resilient_worker"
CLASSICAL_WORKER = "mnemojax._src.bench.mp_classical_worker"


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    from mnemojax._src.distributed.launcher.scenario import process_alive

    return process_alive(pid)


# Steps past the killed one for the third figure: the slow steps after a recovery (the next
# candidate worlds compile in the background) count there, and a restart's redone steps.
STEPS_PAST = 10


def kill_figures(steps: list[dict], *, killed: int, t_kill: float, new_world) -> dict:
    """Kill → next good step, kill → killed step done again, and kill → `STEPS_PAST`
    steps past the killed one (None where the run ends before), from step events.

    ``killed`` is the first step the world before the kill never completed;
    ``new_world(event)`` tells the steps of the world after the kill. A step counts once
    every process that logged such steps has logged it.
    """
    after = [e for e in steps if e["time"] > t_kill and new_world(e)]
    owners = sorted({e["pid"] for e in after})
    first = {p: min(e["time"] for e in after if e["pid"] == p) for p in owners}

    def every_process_at(step: int) -> float | None:
        at = [min((e["time"] for e in after if e["pid"] == p and e["step"] >= step),
                  default=None) for p in owners]
        reached = [t for t in at if t is not None]
        return max(reached) - t_kill if reached and len(reached) == len(at) else None

    return {"killed_step": killed,
            "next_good_step_s": max(first.values()) - t_kill if first else None,
            "back_past_killed_step_s": every_process_at(killed),
            "steps_past_killed_s": every_process_at(killed + STEPS_PAST),
            "processes_after": len(owners)}


# -- (e) mnemojax under the launcher --------------------------------------------------------


def launch_resilient_workers(*, preset: str, steps: int, out: Path, run: str, nproc: int,
                             devices_per_proc: int, faults, compile_cache: str | None,
                             collective_timeout_s: int | None = None,
                             timeout_s: float = 600.0, worker_args: Sequence[str] = ()
                             ) -> dict:
    """`mp_resilient_worker` on ``nproc`` workers under the launcher with its default
    options (but ``collective_timeout_s`` when given), firing ``faults``; the workers'
    output goes to ``out/workers.log``; ``worker_args`` are added to each worker's
    command line. Returns `run_scenario`'s report (also ``tests.jobs.two_kills``)."""
    from mnemojax._src.distributed.launcher.options import LaunchOptions
    from mnemojax._src.distributed.launcher.scenario import run_scenario

    defaults = LaunchOptions(nproc=nproc)
    worker = [sys.executable, "-m", RESILIENT_WORKER, "--preset", preset, "--steps",
              str(steps), "--out", str(out), "--run", run]
    if compile_cache:
        worker += ["--compile-cache", compile_cache]
    worker += list(worker_args)
    # The output goes to a log, not the caller's table; exec keeps the pid the agent
    # watches (and the scenario kills).
    cmd = ["/bin/sh", "-c", f'exec "$0" "$@" >>"{out / "workers.log"}" 2>&1', *worker]
    return run_scenario(cmd, nproc=nproc, devices_per_proc=devices_per_proc, faults=faults,
                        collective_timeout_s=collective_timeout_s
                        or defaults.collective_timeout_s,
                        heartbeat_s=defaults.heartbeat_s,
                        agree_timeout_s=defaults.agree_timeout_s,
                        hang_min_s=defaults.hang_min_s, job_timeout_s=timeout_s)


def run_mnemojax_job(cfg, *, preset: str, out_dir: str | os.PathLike, nproc: int,
                     devices_per_proc: int, victim: int, kill_after_step: int,
                     compile_cache: str | None, collective_timeout_s: int | None = None,
                     timeout_s: float = 600.0, worker_args: Sequence[str] = ()) -> dict:
    """Runs (e) and returns its figures; the final state is ``out_dir/final.npz``.

    Args:
        collective_timeout_s: None: the launcher's default (`LaunchOptions`); every other
            launch option is the launcher's default.
        worker_args: added to each worker's command (`mp_resilient_worker`'s options).

    Raises:
        BaselineError: the job did not end with status 0, the kill did not fire, or a
            process or shared-memory segment outlived it.
    """
    from mnemojax._src.distributed.launcher.options import LaunchOptions
    from mnemojax._src.distributed.launcher.scenario import ProcessFault

    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = out / "workers.log"
    timeout = collective_timeout_s or LaunchOptions(nproc=nproc).collective_timeout_s
    t_start = time.time()
    report = launch_resilient_workers(
        preset=preset, steps=cfg.steps, out=out, run=RUN_E, nproc=nproc,
        devices_per_proc=devices_per_proc, faults=[ProcessFault("kill", victim, kill_after_step)],
        compile_cache=compile_cache, collective_timeout_s=timeout, timeout_s=timeout_s,
        worker_args=worker_args)
    left = [p for p in report["pids"] if _alive(p)]
    fired = report["fired"]
    if report["rc"] != 0 or len(fired) != 1 or "error" in fired[0] or left or \
            report["shm_left"]:
        raise BaselineError(
            f"bench run (e): launcher rc={report['rc']}, fired={fired}, unfired="
            f"{report['unfired']}, processes left={left}, shm left={report['shm_left']}",
            returncode=report["rc"], stderr_tail=_tail(log))
    t_kill = fired[0]["t"]
    events = list(read_events(out / "events.jsonl"))
    steps = [e for e in events if e["kind"] == "step"]
    # The call of the step that failed returns once the survivors have recovered and
    # replayed it (flagged in its event); a lower step logged after the kill was completed
    # before it, only its event came later.
    recovered = [e["step"] for e in steps if e["after_recovery"]]
    if not recovered:
        raise BaselineError("bench run (e): no step recovered after the kill",
                            returncode=report["rc"], stderr_tail=_tail(log))
    figures = kill_figures(steps, killed=min(recovered), t_kill=t_kill,
                           new_world=lambda e: e["step"] >= min(recovered))
    stats = json.loads((out / "stats.json").read_text())
    rec = (stats.get("recoveries") or [{}])[0]
    return {
        **figures, "nproc": nproc, "devices_per_proc": devices_per_proc, "victim": victim,
        "collective_timeout_s": timeout,
        "launch_options": "launcher defaults" if collective_timeout_s is None else
                          f"launcher defaults but collective_timeout_s={timeout}",
        "launcher_knows_s": report["launcher_knows_s"],
        "steps_lost": rec.get("steps_lost"),
        "executable": rec.get("executable"),
        "from_export": rec.get("from_export"),
        "recovery_phases_s": rec.get("phases_s", {}),
        "recovery_total_s": rec.get("total_s"),
        "recoveries": len(stats.get("recoveries") or []),
        # candidate worlds' exports the last world's processes took from process 0
        "exports_taken": sum(e.get("exports_taken", 0) for e in events
                             if e["kind"] == "run_end"),
        "wall_s": max(e["time"] for e in steps) - t_start,
        "timeline": sorted({(e["time"] - t_start, e["step"]) for e in steps
                            if e["worker"] == min(x["worker"] for x in steps)}),
        "fault_at_s": t_kill - t_start,
        "final_loss": steps[-1]["loss"],
    }


# -- (f) the classical job, restarted by a supervisor ---------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _StepWatch:
    """Reads the step events appended to a JSONL log since the last call."""

    def __init__(self, path: Path):
        self.path, self._offset = path, 0

    def new_steps(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("kind") == "step":
                    out.append(event)
        return out


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_classical_job(cfg, *, preset: str, out_dir: str | os.PathLike, nproc: int,
                      devices_per_proc: int, victim: int, kill_after_step: int,
                      interval_steps: int, compile_cache: str | None,
                      timeout_s: float = 600.0) -> dict:
    """Runs (f) and returns its figures; the final state is ``out_dir/final.npz``.

    Raises:
        BaselineError: a process failed other than by the kill, the victim finished before
            it, or the deadline passed (everything is killed first).
    """
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    events, log, ckpt = out / "events.jsonl", out / "workers.log", out / "ckpt"
    watch = _StepWatch(events)
    deadline = time.monotonic() + timeout_s
    t_start = time.time()
    launches: list[dict] = []
    kill: dict | None = None
    procs: list[subprocess.Popen] = []
    all_pids: list[int] = []
    redo_until = 0
    try:
        with log.open("ab") as sink:
            for launch in range(2):  # one kill: the first launch and one restart
                launched_at = time.time()
                coordinator = f"127.0.0.1:{_free_port()}"
                procs = []  # appended one by one: a failed start leaves none unended
                for i in range(nproc):
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", CLASSICAL_WORKER, "--preset", preset,
                         "--steps", str(cfg.steps), "--coordinator", coordinator,
                         "--process-id", str(i), "--nproc", str(nproc),
                         "--devices-per-proc", str(devices_per_proc), "--ckpt-dir", str(ckpt),
                         "--events", str(events), "--run", RUN_F,
                         "--interval", str(interval_steps), "--redo-until", str(redo_until),
                         "--launched-at", repr(launched_at), "--launch", str(launch),
                         "--final-state", str(out / "final.npz")]
                        + (["--compile-cache", compile_cache] if compile_cache else []),
                        stdout=sink, stderr=sink,
                        env={**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}))
                    all_pids.append(procs[-1].pid)
                while True:
                    codes = [p.poll() for p in procs]
                    if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                        break
                    if time.monotonic() > deadline:
                        raise BaselineError(f"bench run (f) ran past {timeout_s:.0f} s",
                                            returncode=None, stderr_tail=_tail(log))
                    for e in watch.new_steps():
                        if (kill is None and e["launch"] == 0 and e["process"] == victim
                                and e["step"] >= kill_after_step):
                            kill = {"t": time.time(), "pid": procs[victim].pid,
                                    "after_step": e["step"]}
                            os.kill(procs[victim].pid, signal.SIGKILL)
                    time.sleep(0.005)
                exited_at = time.time()
                codes = [p.poll() for p in procs]
                record = {"launch": launch, "pids": [p.pid for p in procs],
                          "launched_at": launched_at, "exited_at": exited_at}
                if all(c == 0 for c in codes):
                    launches.append({**record, "returncodes": codes})
                    break
                expected = (launch == 0 and kill is not None
                            and codes[victim] == -signal.SIGKILL)
                _stop(procs)  # the supervisor's reaction: every process goes
                launches.append({**record, "returncodes": codes,
                                 "torn_down_at": time.time()})
                if not expected:
                    raise BaselineError(f"bench run (f): launch {launch} ended with "
                                        f"{codes} (kill: {kill})", returncode=None,
                                        stderr_tail=_tail(log))
                redo_until = max(e["step"] for e in read_events(events)
                                 if e["kind"] == "step")
            else:
                raise BaselineError("bench run (f): still failing after the restart",
                                    returncode=None, stderr_tail=_tail(log))
    finally:
        _stop(procs)
    if kill is None:
        raise BaselineError("bench run (f): the victim was never killed", returncode=None,
                            stderr_tail=_tail(log))
    if left := [p for p in all_pids if _alive(p)]:
        raise BaselineError(f"bench run (f): processes {left} outlived the job",
                            returncode=None, stderr_tail=_tail(log))
    log_events = [e for e in read_events(events) if e.get("run") == RUN_F]
    steps = [e for e in log_events if e["kind"] == "step"]
    # The first step the first launch never completed (a survivor may log a step the
    # victim completed but was killed before logging).
    killed = max((e["step"] for e in steps if e["launch"] == 0), default=0) + 1
    figures = kill_figures(steps, killed=killed, t_kill=kill["t"],
                           new_world=lambda e: e["launch"] == 1)
    mine = [e for e in log_events if e.get("launch") == 1]

    def slowest(kind: str, field: str = "duration_s", phase: str | None = None) -> float:
        xs = [e[field] for e in mine
              if e["kind"] == kind and (phase is None or e.get("phase") == phase)]
        return max(xs) if xs else 0.0

    first, second = launches[0], launches[1]
    restored = [e["step"] for e in mine if e["kind"] == "checkpoint_restore"]
    redone = sorted({e["step"] for e in steps if e["launch"] == 1 and e["replay"]})
    saves = [e for e in log_events if e["kind"] == "checkpoint_save"]
    return {
        **figures, "nproc": nproc, "devices_per_proc": devices_per_proc, "victim": victim,
        "interval_steps": interval_steps,
        "restored_step": restored[0] if restored else 0,
        "steps_lost": len(redone),
        "phases_s": {  # the slowest process of the restart, per phase
            "detect": first["exited_at"] - kill["t"],
            "teardown": first["torn_down_at"] - first["exited_at"],
            "relaunch": second["launched_at"] - first["torn_down_at"],
            "start+import": slowest("startup", "process_start_import_s", "start+init"),
            "jax.distributed": slowest("startup", "distributed_init_s", "start+init"),
            "init": slowest("startup", "init_s", "start+init"),
            "restore": slowest("checkpoint_restore"),
            "compile": slowest("startup", phase="compile"),
        },
        "checkpoint_saves": len(saves),
        "launches": launches,
        "wall_s": max(e["time"] for e in log_events) - t_start,
        "timeline": [(e["time"] - t_start, e["step"]) for e in steps if e["process"] == 0],
        "fault_at_s": kill["t"] - t_start,
        "final_loss": steps[-1]["loss"],
    }
