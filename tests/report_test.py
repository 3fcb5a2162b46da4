"""Tests of the offline goodput report (mnemojax/_src/bench/report.py, report_cli.py)."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from mnemojax._src.bench import report
from mnemojax._src.cli import main as cli_main

T0 = 1_700_000_000.0


def _event(t, kind, step=None, duration_s=None, run="job", **fields):
    return {"time": T0 + t, "run": run, "kind": kind, "step": step,
            "duration_s": duration_s, **fields}


# A job of 10 s: 2 s startup, two steps, a save, a kill, a restart, a restore, one step
# redone, one new step, and 2 s nobody booked.
HAND_WRITTEN = [
    _event(0.0, "run_start"),
    _event(2.0, "startup", duration_s=2.0, phase="start+init"),
    _event(3.0, "step", 1, 1.0),
    _event(4.0, "step", 2, 1.0),
    _event(4.5, "checkpoint_save", 2, 0.5, blocking=True),
    _event(4.6, "snapshot", 2, 0.3, blocking=False),  # background copy: free
    _event(5.0, "fault", 3, classification="process_killed"),
    _event(6.0, "restart", 3, 1.0),
    _event(6.5, "checkpoint_restore", 1, 0.5),
    _event(7.5, "step", 2, 1.0, replay=True),
    _event(8.5, "step", 3, 1.0),
    _event(10.0, "run_end", 3),
]


def _write(path: pathlib.Path, events, torn: str | None = None) -> pathlib.Path:
    text = "".join(json.dumps(e) + "\n" for e in events)
    path.write_text(text + (torn or ""))
    return path


def test_goodput_math_on_a_hand_written_log():
    acc = report.account(HAND_WRITTEN)
    assert acc.wall_s == pytest.approx(10.0)
    assert acc.productive_s == pytest.approx(3.0)
    assert acc.goodput_pct == pytest.approx(30.0)
    assert acc.badput_pct == pytest.approx({
        "startup": 20.0, "checkpoint_save": 5.0, "checkpoint_restore": 5.0,
        "infra_recovery": 0.0, "wasted_progress": 10.0, "restart": 10.0, "snapshot": 0.0,
        "other": 20.0})
    assert acc.goodput_pct + sum(acc.badput_pct.values()) == pytest.approx(100.0)
    assert acc.steps == 3 and acc.faults == 1 and acc.overlap_s == 0.0
    assert acc.faults_at == [(pytest.approx(5.0), 3)]


def test_infra_recovery_and_wasted_progress_events():
    events = [_event(0.0, "run_start"), _event(1.0, "step", 1, 1.0),
              _event(1.5, "wasted_progress", 2, 0.5, steps=0, partial_step=True),
              _event(1.6, "recovery_phase", 2, 0.1, phase="detect"),
              _event(2.0, "recovery_phase", 2, 0.4, phase="compile"),
              _event(2.0, "recovery", 2, 0.5, steps_lost=0),  # a summary: not booked again
              _event(3.0, "step", 2, 1.0)]
    acc = report.account(events)
    assert acc.goodput_pct == pytest.approx(200 / 3)
    assert acc.badput_s["infra_recovery"] == pytest.approx(0.5)
    assert acc.badput_s["wasted_progress"] == pytest.approx(0.5)
    assert acc.badput_s["other"] == pytest.approx(0.0)


def test_overlapping_events_are_reported_not_hidden():
    events = [_event(0.0, "run_start"), _event(1.0, "step", 1, 1.0),
              _event(1.0, "startup", duration_s=1.0)]
    acc = report.account(events)
    assert acc.badput_s["other"] == 0.0
    assert acc.overlap_s == pytest.approx(1.0)


def test_runs_are_grouped_and_a_torn_last_line_is_skipped(tmp_path):
    other = [{**e, "run": "second", "time": e["time"] + 100} for e in HAND_WRITTEN]
    path = _write(tmp_path / "run.jsonl", HAND_WRITTEN + other,
                  torn='{"time": 1700000200.0, "run": "second", "kind": "st')
    accounts = report.account_log(path)
    assert [a.run for a in accounts] == ["job", "second"]
    for a in accounts:
        assert a.goodput_pct == pytest.approx(30.0)
        assert a.wall_s == pytest.approx(10.0)
    table = report.format_table(accounts)
    assert "job" in table and "second" in table and "30.0" in table


def test_empty_run_is_a_typed_error():
    with pytest.raises(ValueError, match="events"):
        report.account([])


def test_cli_writes_png_and_json(tmp_path, capsys):
    path = _write(tmp_path / "run.jsonl", HAND_WRITTEN, torn='{"torn')
    out = tmp_path / "out"
    assert cli_main(["report", str(path), "--out", str(out)]) == 0
    png = out / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "report.json").read_text())
    assert data[0]["goodput_pct"] == pytest.approx(30.0)
    assert "goodput%" in capsys.readouterr().out


def test_cli_rejects_a_missing_log_and_an_unknown_run(tmp_path, capsys):
    """Bad input: status 2 and one line naming it, no traceback."""
    assert cli_main(["report", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mnemojax report: error: ") and "nope.jsonl" in err
    assert "Traceback" not in err and err.count("\n") == 1
    path = _write(tmp_path / "run.jsonl", HAND_WRITTEN)
    assert cli_main(["report", str(path), "--run", "ghost"]) == 2
    assert "ghost" in capsys.readouterr().err


def test_report_code_never_imports_jax():
    root = pathlib.Path(report.__file__).parent
    for name in ("report.py", "report_cli.py", "plots.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] not in ("jax", "jaxlib", "flax", "orbax"), (name, mod)
