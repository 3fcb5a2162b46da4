"""`compiler.ExportSharing` over `coordination.SharedExports`: one process traces and exports
a candidate world's step, the others take its export through the coordination service."""

from __future__ import annotations

import json

from tests import helpers


def test_a_peer_takes_process_0s_export_and_compiles_the_step_from_it_untraced(tmp_path):
    """Two processes × 2 CPU devices (`tests.jobs.shared_exports`), the step's batch a
    dataclass of the program's own (which jax.export cannot serialise: the export travels
    with flat structures, and the taker puts its own back). Process 0 traces the candidate
    once to export it; process 1 does not trace it at all, takes the export (in many
    pieces) and compiles from it. A second candidate goes as on one host by default:
    process 1 keeps the export it takes and loads the executable process 0 compiled (the
    cache key of a taken export is the publisher's). Every executable computes what numpy
    does."""
    helpers.run_two_processes("tests.jobs.shared_exports", str(tmp_path / "cache"),
                              str(tmp_path))
    p0, p1 = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    assert p0["finished"] and p1["finished"]
    assert (p0["traces_after_first"], p0["taken"]) == (2, 0), p0
    assert (p1["traces_after_first"], p1["taken"]) == (0, 2), p1
    assert p0["from_export"] and p1["from_export"]
    assert p0["second_from_export"] and p1["second_from_export"]
    assert (p0["where_second"], p1["where_second"]) == ("ready", "cached")
    assert max(p0["max_error"], p1["max_error"]) < 1e-5
