"""The JSONL event log (mnemojax._src.events): fields, one line per event, torn lines."""

import json
import threading

import numpy as np
import pytest

from mnemojax._src.events import KINDS, EventLog, jsonable, read_events


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_every_event_has_the_common_fields_and_its_own(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl", "run-a")
    log.emit("run_start", config={"steps": 3})
    log.emit("step", step=1, duration_s=0.25, replay=False)
    log.emit("fault", step=2, failed_devices=[3], classification="device_failure",
             time_s=123.5)
    log.close()
    start, step, fault = (json.loads(line) for line in _lines(tmp_path / "ev.jsonl"))
    for event in (start, step, fault):
        assert {"time", "run", "kind", "step", "duration_s"} <= event.keys()
        assert event["run"] == "run-a"
    assert start["kind"] == "run_start" and start["step"] is None
    assert start["duration_s"] is None and start["config"] == {"steps": 3}
    assert isinstance(start["time"], float) and start["time"] > 1e9  # unix seconds
    assert (step["kind"], step["step"], step["duration_s"], step["replay"]) == (
        "step", 1, 0.25, False)
    assert fault["time"] == 123.5 and fault["failed_devices"] == [3]


def test_each_event_is_on_disk_as_soon_as_it_is_emitted(tmp_path):
    """A crash loses no event: the line is flushed before emit returns."""
    log = EventLog(tmp_path / "ev.jsonl", "r")
    log.emit("step", step=1)
    assert [json.loads(x)["step"] for x in _lines(tmp_path / "ev.jsonl")] == [1]
    log.emit("step", step=2)
    assert len(_lines(tmp_path / "ev.jsonl")) == 2
    log.close()


def test_unknown_kind_is_rejected_and_nothing_is_written(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl", "r")
    with pytest.raises(ValueError, match="kind='stpe'") as info:
        log.emit("stpe", step=1)
    assert "run_start" in str(info.value)  # the legal kinds are listed
    log.close()
    assert _lines(tmp_path / "ev.jsonl") == []


def test_known_kinds_cover_the_documented_goodput_schema():
    assert {"run_start", "startup", "step", "snapshot", "checkpoint_save",
            "checkpoint_restore", "fault", "recovery_phase", "recovery",
            "wasted_progress", "restart", "preemption", "run_end"} == KINDS


def test_parent_directories_are_created_and_logs_append(tmp_path):
    path = tmp_path / "a" / "b" / "ev.jsonl"
    first = EventLog(path, "first")
    first.emit("run_start")
    first.close()
    second = EventLog(path, "second")  # e.g. the job restarted after a crash
    second.emit("run_start")
    second.close()
    assert [e["run"] for e in read_events(path)] == ["first", "second"]


def test_emit_after_close_is_dropped(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl", "r")
    log.emit("step", step=1)
    log.close()
    log.emit("step", step=2)  # e.g. a background thread reporting after shutdown
    assert [e["step"] for e in read_events(tmp_path / "ev.jsonl")] == [1]


def test_concurrent_emits_never_interleave_within_a_line(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl", "r")
    payload = "x" * 5000  # longer than one buffer chunk

    def emit_many(thread):
        for i in range(50):
            log.emit("snapshot", step=i, thread=thread, payload=payload)

    threads = [threading.Thread(target=emit_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    events = [json.loads(line) for line in _lines(tmp_path / "ev.jsonl")]  # all parse
    assert len(events) == 200
    for t in range(4):
        assert [e["step"] for e in events if e["thread"] == t] == list(range(50))


def test_values_json_cannot_encode_are_converted():
    assert jsonable(np.arange(3)) == [0, 1, 2]
    assert jsonable(np.float32(1.5)) == 1.5
    assert sorted(jsonable({3, 1})) == [1, 3] and jsonable((1, 2)) == [1, 2]
    assert jsonable(frozenset({4})) == [4]
    assert jsonable(object).startswith("<class")


def test_arrays_and_sets_in_fields_round_trip(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl", "r")
    log.emit("recovery", step=4, new_mesh_devices=np.array([0, 1, 2]), lost={5},
             shape=(3, 2))
    log.close()
    [event] = read_events(tmp_path / "ev.jsonl")
    assert event["new_mesh_devices"] == [0, 1, 2] and event["lost"] == [5]
    assert event["shape"] == [3, 2]


def test_reader_skips_blank_lines_and_a_torn_last_line(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, "r")
    log.emit("step", step=1)
    log.emit("step", step=2)
    log.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n")
        f.write('{"time": 1.0, "run": "r", "kind": "st')  # a crash mid-write
    assert [e["step"] for e in read_events(path)] == [1, 2]
