"""The run event log: one JSON object per line, in goodput terms.

Every run (mnemojax, the classical baseline, the bench) writes the same schema, so one
report renders any of them and goodput/badput are computed offline.

Each line: ``{"time": <unix s>, "run": <run id>, "kind": <kind>, "step": <int|null>,
"duration_s": <float|null>, ...}``. Kinds and their goodput category:

=====================  ======================================================
kind                   category / meaning
=====================  ======================================================
``run_start``          marks t=0 of a run (``config`` field)
``startup``            badput: program startup (imports, init, first compile)
``step``               productive step time (``replay: true`` -> wasted progress)
``snapshot``           host snapshot copy (``blocking: false``: off the critical path)
``checkpoint_save``    badput: the blocking part of a persistent checkpoint save
``checkpoint_restore`` badput: restoring a persistent checkpoint
``fault``              a failure seen (``failed_devices``, ``classification``; also
                       ``snapshot_budget``, ``step_compile``: the step does not compile
                       for a recovery's mesh, and ``left_job``: the new mesh gave this
                       process no device, and it left the job)
``recovery_phase``     badput: infrastructure recovery (``phase``: detect/plan/...)
``recovery``           summary of one recovery (``total_s``, ``steps_lost``, ...)
``wasted_progress``    badput: completed steps recomputed (``steps``)
``restart``            badput: a whole-job restart (baseline; ``duration_s`` until
                       the new process is ready to train)
``preemption``         a preemption notice or memory-pressure trigger
``run_end``            marks the end of a run (``steps``)
=====================  ======================================================
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KINDS = frozenset({
    "run_start", "startup", "step", "snapshot", "checkpoint_save", "checkpoint_restore",
    "fault", "recovery_phase", "recovery", "wasted_progress", "restart", "preemption",
    "run_end",
})


class EventLog:
    """Appends events to a JSONL file; each line is flushed (a crash loses no event).

    Several processes may append to one file (the baseline's restarts do): every event
    is one ``write`` of one line in append mode.
    """

    def __init__(self, path: str | os.PathLike[str], run: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = run
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def emit(self, kind: str, *, step: int | None = None, duration_s: float | None = None,
             time_s: float | None = None, **fields: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"event kind={kind!r} is invalid: expected one of {sorted(KINDS)}")
        record = {"time": time.time() if time_s is None else time_s, "run": self.run,
                  "kind": kind, "step": step, "duration_s": duration_s, **fields}
        line = json.dumps(record, default=jsonable) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def jsonable(x: Any) -> Any:
    """`json.dumps` default: arrays to lists, sets and tuples to lists, else str."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the events of a JSONL log; a torn last line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
