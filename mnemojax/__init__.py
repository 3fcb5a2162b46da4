"""mnemojax: keep JAX training alive through device and host failures, with the same math.

`import mnemojax` stays light: it imports neither JAX nor the process roles. The names
that need them (`resilient`, `ResilientStep`, `initialize`, `data`, `testing`) are imported on
first use, so the JAX-free commands (`mnemojax simulate`, `mnemojax report`) start fast.
"""

import importlib as _importlib
import typing as _typing

from mnemojax import errors as errors
from mnemojax import retry as retry
from mnemojax._src.options import CompileOptions as CompileOptions
from mnemojax._src.options import PersistentOptions as PersistentOptions
from mnemojax._src.options import RecoveryOptions as RecoveryOptions
from mnemojax._src.options import ResilienceOptions as ResilienceOptions
from mnemojax._src.options import SnapshotOptions as SnapshotOptions
from mnemojax._src.statistics import JoinRecord as JoinRecord
from mnemojax._src.statistics import RecoveryRecord as RecoveryRecord
from mnemojax._src.statistics import Statistics as Statistics
from mnemojax._src.topology import MeshPlan as MeshPlan
from mnemojax._src.topology import plan_reduced_mesh as plan_reduced_mesh

if _typing.TYPE_CHECKING:
    from mnemojax import data as data
    from mnemojax import testing as testing
    from mnemojax._src.api import ResilientStep as ResilientStep
    from mnemojax._src.api import resilient as resilient
    from mnemojax._src.distributed.worker.session import initialize as initialize
    from mnemojax._src.persistent import checkpoint_barrier as checkpoint_barrier

__version__ = "0.1.0.dev0"

__all__ = [
    "CompileOptions",
    "JoinRecord",
    "MeshPlan",
    "PersistentOptions",
    "RecoveryOptions",
    "RecoveryRecord",
    "ResilienceOptions",
    "ResilientStep",
    "SnapshotOptions",
    "Statistics",
    "checkpoint_barrier",
    "data",
    "errors",
    "initialize",
    "plan_reduced_mesh",
    "resilient",
    "retry",
    "testing",
]

# Public name -> the module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {
    "ResilientStep": "mnemojax._src.api",
    "resilient": "mnemojax._src.api",
    "initialize": "mnemojax._src.distributed.worker.session",
    "checkpoint_barrier": "mnemojax._src.persistent",
}


def __getattr__(name: str) -> _typing.Any:
    if name in ("data", "testing"):
        return _importlib.import_module(f"mnemojax.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'mnemojax' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
