"""Typed errors and warnings of mnemojax, rooted at `MnemojaxError` / `MnemojaxWarning`."""

from mnemojax._src.errors import AgreementError as AgreementError
from mnemojax._src.errors import BaselineError as BaselineError
from mnemojax._src.errors import BatchSplitError as BatchSplitError
from mnemojax._src.errors import CheckpointCorruptError as CheckpointCorruptError
from mnemojax._src.errors import CheckpointLostError as CheckpointLostError
from mnemojax._src.errors import CheckpointMismatchError as CheckpointMismatchError
from mnemojax._src.errors import CheckpointSaveError as CheckpointSaveError
from mnemojax._src.errors import DeviceFailureError as DeviceFailureError
from mnemojax._src.errors import DistributedError as DistributedError
from mnemojax._src.errors import GuardSkippedError as GuardSkippedError
from mnemojax._src.errors import InvalidOptionError as InvalidOptionError
from mnemojax._src.errors import LeftJobExit as LeftJobExit
from mnemojax._src.errors import LossCheckWarning as LossCheckWarning
from mnemojax._src.errors import MathChangedWarning as MathChangedWarning
from mnemojax._src.errors import MeshTooSmallError as MeshTooSmallError
from mnemojax._src.errors import MnemojaxError as MnemojaxError
from mnemojax._src.errors import MnemojaxWarning as MnemojaxWarning
from mnemojax._src.errors import NonFiniteLossError as NonFiniteLossError
from mnemojax._src.errors import NonFiniteSkipWarning as NonFiniteSkipWarning
from mnemojax._src.errors import PreemptionExit as PreemptionExit
from mnemojax._src.errors import ProtocolError as ProtocolError
from mnemojax._src.errors import RecoveryExhaustedError as RecoveryExhaustedError
from mnemojax._src.errors import ShardingMismatchError as ShardingMismatchError
from mnemojax._src.errors import SimulationConfigError as SimulationConfigError
from mnemojax._src.errors import SnapshotBudgetWarning as SnapshotBudgetWarning
from mnemojax._src.errors import SnapshotCorruptError as SnapshotCorruptError
from mnemojax._src.errors import StateUnavailableError as StateUnavailableError
from mnemojax._src.errors import StepCompileError as StepCompileError
from mnemojax._src.errors import StepHangError as StepHangError
from mnemojax._src.errors import UnsupportedJaxVersionError as UnsupportedJaxVersionError
from mnemojax._src.errors import UnsupportedStateError as UnsupportedStateError
from mnemojax._src.errors import WorldConfigError as WorldConfigError

__all__ = [
    "AgreementError",
    "BaselineError",
    "BatchSplitError",
    "CheckpointCorruptError",
    "CheckpointLostError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "DeviceFailureError",
    "DistributedError",
    "GuardSkippedError",
    "InvalidOptionError",
    "LeftJobExit",
    "LossCheckWarning",
    "MathChangedWarning",
    "MeshTooSmallError",
    "MnemojaxError",
    "MnemojaxWarning",
    "NonFiniteLossError",
    "NonFiniteSkipWarning",
    "PreemptionExit",
    "ProtocolError",
    "RecoveryExhaustedError",
    "ShardingMismatchError",
    "SimulationConfigError",
    "SnapshotBudgetWarning",
    "SnapshotCorruptError",
    "StateUnavailableError",
    "StepCompileError",
    "StepHangError",
    "UnsupportedJaxVersionError",
    "UnsupportedStateError",
    "WorldConfigError",
]


def _as_public() -> None:
    """Tracebacks name the public module, where users import the classes from."""
    for name in __all__:
        globals()[name].__module__ = __name__


_as_public()
