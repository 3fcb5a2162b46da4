"""The main job end to end on the tiny preset: faults, recovery, same math, report."""

import json

import pytest

from mnemojax._src import cli
from mnemojax._src.config import shipped_config
from tests.report_checks import check_demo_report

# Slow (~60 s): CI runs the demo through the wheel test (`make wheel-test`) with the same
# checks (tests/report_checks.py).
pytestmark = [pytest.mark.needs8, pytest.mark.slow]


def test_demo_recovers_and_matches_reference(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = cli.main(["demo", "--config", str(shipped_config("tiny.toml")), "--quiet",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    check_demo_report(report)
    printed = capsys.readouterr().out
    assert "mnemojax demo report" in printed and "MATCH" in printed
