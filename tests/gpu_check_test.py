"""`make gpu-check` (`mnemojax._src.bench.gpu_check`): skips cleanly without a GPU, and
its whole run works on the 8 CPU devices (the figures are the tool's check, not data)."""

from __future__ import annotations

import json

import pytest

from mnemojax._src.bench import gpu_check


@pytest.mark.skipif(not isinstance(gpu_check._platform_devices("gpu"), str),
                    reason="a GPU is visible")
def test_without_a_gpu_the_check_says_so_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu-check: skipped, no gpu device") and "--platform cpu" in out


def test_the_check_runs_on_cpu_devices_and_reports_every_figure(tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setattr(gpu_check, "_prefer", lambda platform: None)  # JAX config stays
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--platform", "cpu", "--devices", "2", "--steps", "3",
                           "--rounds", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["platform"] == "cpu" and r["devices"] == 2 and r["batch_size"] == 16
    state = r["state_bytes"]
    assert state > 0 and r["d2h_snapshot"]["bytes"] >= state  # + the optimizer's step count
    assert r["params"] == 13_280 and "13,280 params" in printed
    for key in ("d2h_device_get", "d2h_snapshot"):
        d = r[key]
        assert d["gbs"] > 0 and d["median_s"] > 0, (key, d)
        assert d["pct_of_pcie_peak"] == pytest.approx(100 * d["gbs"] / r["pcie_peak_gbs"])
    assert set(r["median_step_s"]) == {"plain_flax", "mnemojax_no_snapshots",
                                       "mnemojax_default", "mnemojax_snapshot_every_step"}
    assert set(r["step_overhead_vs_plain"]) == set(r["median_step_s"]) - {"plain_flax"}
    assert r["every_step_snapshot_overhead"] > 0 and r["every_step_target"] == 1.03
    # (on CPU the every-step run packs already: no separate packed run)
    assert r["every_step_packed_overhead"] is None and "pack_copies=True" not in printed
    on_gpu = gpu_check.format_table(dict(r, every_step_packed_overhead=1.02))
    assert "packed by the step (pack_copies=True): x1.020" in on_gpu
    assert "of PCIe peak" in printed and "every-step snapshot overhead" in printed


@pytest.mark.parametrize("argv, bad", [(["--steps", "0"], "--steps=0"),
                                       (["--rounds", "-1"], "--rounds=-1"),
                                       (["--devices", "0"], "--devices=0")])
def test_bad_arguments_are_named(argv, bad, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--platform", "cpu", *argv])
    assert bad in capsys.readouterr().err
