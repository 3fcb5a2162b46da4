"""Fixtures of the multi-process layer's unit tests."""

from __future__ import annotations

import threading

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agent.agent import Agent
from tests.distributed.fakes import SECRET, FakeLauncher, wait_until


@pytest.fixture
def two_agents():
    """Two agents (threads of this process, no workers) linked to a fake launcher."""
    fake = FakeLauncher()
    agents = [Agent(worker_id=i, launcher=fake.address, command=[], secret=SECRET)
              for i in range(2)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    wait_until(lambda: len(fake.addresses) == 2)
    yield fake, agents
    for i in list(fake.links):
        fake.command(i, wire.Shutdown())
    for t in threads:
        t.join(timeout=10)
    fake.close()
    assert not any(t.is_alive() for t in threads)
