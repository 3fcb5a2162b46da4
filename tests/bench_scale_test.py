"""The scale curve (`mnemojax._src.bench.scale`): its table, plot and arguments; the whole
measurement at the smallest size in `make test-slow`."""

import json
import math

import pytest

from mnemojax._src.bench import scale


def _row(size, params, recovery_s, overhead):
    return {"size": size, "params": params, "state_bytes": 3 * 4 * params,
            "step_s": {"a": 0.01 * params / 1e5, "b": 0.01 * overhead * params / 1e5},
            "snapshot_overhead": overhead, "snapshot_bytes": 12 * params,
            "snapshot_host_bytes": 24 * params, "snapshot_host_over_state": 2.0,
            "recovery": {"total_s": recovery_s, "over_step": 5.0, "executable": "ready"}}


def test_the_table_and_plot_show_every_size(tmp_path):
    rows = [_row("0.1m", 1e5, 0.15, 1.4), _row("11m", 1.1e7, 1.2, 1.1),
            _row("40m", 4e7, 6.0, 1.05)]
    rows[2]["recovery"] = None  # a size whose fault did not fire shows a gap, not a crash
    text = scale.table(rows)
    assert text.count("\n") == 4  # header, rule, three rows
    assert "| 11m | 11.00 M |" in text and "x1.100" in text and "| 1.200 s |" in text
    assert "| nan s |" in text
    scale.plot(rows, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_fault_is_at_the_middle_step_and_bad_arguments_are_refused():
    cfg = scale.config_for("11m", steps=13, block_steps=3)
    assert [f.step for f in cfg.faults] == [7] and cfg.model == scale.SIZES["11m"]
    with pytest.raises(SystemExit):
        scale.main(["--sizes", "1t"])
    with pytest.raises(SystemExit):
        scale.main(["--steps", "2"])


@pytest.mark.slow
def test_the_smallest_size_measured_end_to_end(tmp_path):
    assert scale.main(["--out", str(tmp_path), "--sizes", "0.1m", "--steps", "6"]) == 0
    [row] = json.loads((tmp_path / "scale.json").read_text())
    assert row["final_allclose_b_to_a"] and row["final_max_diff_c_to_a"] < 1e-4
    assert row["snapshot_host_over_state"] == pytest.approx(2.0, rel=0.05)
    assert row["recovery"]["steps_lost"] <= 1 and not math.isnan(row["snapshot_overhead"])
