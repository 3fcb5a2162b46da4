"""`distributed.env`: the worker's world, from ``MNEMOJAX_*`` or ``SLURM_*``."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed.env import WorldSpec, first_slurm_host, world_from_env
from mnemojax._src.errors import MnemojaxError, WorldConfigError


def test_world_from_mnemojax_env():
    w = world_from_env({"MNEMOJAX_COORDINATOR": "127.0.0.1:1234", "MNEMOJAX_PROCESS_ID": "2",
                        "MNEMOJAX_NUM_PROCESSES": "4", "MNEMOJAX_DEVICES_PER_PROC": "2",
                        "MNEMOJAX_HEARTBEAT_S": "12", "MNEMOJAX_WORKER_ID": "3"})
    assert (w.coordinator, w.process_id, w.num_processes, w.devices_per_proc) == (
        "127.0.0.1:1234", 2, 4, 2)
    assert w.heartbeat_s == 12 and w.collective_timeout_s == 20 and w.stable_id == 3


def test_world_from_slurm_env():
    w = world_from_env({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
                        "SLURM_JOB_NODELIST": "gpu[003-010],cpu1"})
    assert w.coordinator == "gpu003:" + str(8476 + 242)
    assert (w.process_id, w.num_processes, w.stable_id) == (1, 8, 1)
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a[1,5-6]") == "a1"


@pytest.mark.parametrize("env, match", [
    ({}, "no world"),
    ({"MNEMOJAX_COORDINATOR": "h:1"}, "MNEMOJAX_PROCESS_ID"),
    ({"MNEMOJAX_COORDINATOR": "h:1", "MNEMOJAX_PROCESS_ID": "4",
      "MNEMOJAX_NUM_PROCESSES": "4"}, "process_id=4"),
    ({"MNEMOJAX_COORDINATOR": "nohost", "MNEMOJAX_PROCESS_ID": "0",
      "MNEMOJAX_NUM_PROCESSES": "1"}, "host:port"),
    ({"MNEMOJAX_COORDINATOR": "h:1", "MNEMOJAX_PROCESS_ID": "x",
      "MNEMOJAX_NUM_PROCESSES": "1"}, "integer"),
    ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}, "incomplete"),
])
def test_world_errors_are_typed(env, match):
    with pytest.raises(WorldConfigError, match=match) as e:
        world_from_env(env)
    assert isinstance(e.value, MnemojaxError) and isinstance(e.value, ValueError)


def test_worldspec_validates():
    with pytest.raises(WorldConfigError):
        WorldSpec(coordinator="h:1", process_id=0, num_processes=1, devices_per_proc=0)
