"""Fixtures of the multi-process layer's unit tests."""

from __future__ import annotations

import pytest

from tests.distributed.fakes import running_agents


@pytest.fixture
def two_agents():
    """Two agents (threads of this process, no workers) linked to a fake launcher."""
    with running_agents(2) as (fake, agents):
        yield fake, agents
