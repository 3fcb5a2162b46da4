"""`distributed.launcher.scenario`: process faults are validated."""

from __future__ import annotations

import pytest

from mnemojax._src.errors import InvalidOptionError


def test_process_fault_names_a_bad_kind_or_victim():
    from mnemojax.testing import ProcessFault

    with pytest.raises(InvalidOptionError, match="kind='explode'"):
        ProcessFault("explode", 1, 3)
    with pytest.raises(InvalidOptionError, match="victim=-1"):
        ProcessFault("kill", -1, 3)
