"""The main job end to end on the tiny preset: faults, recovery, same math, report."""

import json

import pytest

from mnemojax._src import cli
from mnemojax._src.config import shipped_config

pytestmark = pytest.mark.needs8


def test_demo_recovers_and_matches_reference(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = cli.main(["demo", "--config", str(shipped_config("tiny.toml")), "--quiet",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["final_state_matches_reference"]
    recs = report["statistics"]["recoveries"]
    assert [r["step"] for r in recs] == [5, 9]
    assert [r["failed_devices"] for r in recs] == [[3], [5]]
    assert recs[0]["executable"] == "ready"  # compiled ahead: no compile on the critical path
    assert all(r["steps_lost"] == 0 and r["source"] == "live_replicas" for r in recs)
    assert report["statistics"]["steps_run"] == 12
    assert set(report["overhead"]["median_step_s"]) == {
        "plain_flax", "mnemojax_no_snapshots", "mnemojax_default",
        "mnemojax_snapshot_every_step"}
    printed = capsys.readouterr().out
    assert "mnemojax demo report" in printed and "MATCH" in printed
