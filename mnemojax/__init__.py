"""mnemojax: keep JAX training alive through device and host failures, with the same math."""

from mnemojax import errors as errors
from mnemojax import retry as retry
from mnemojax import testing as testing
from mnemojax._src.api import ResilientStep as ResilientStep
from mnemojax._src.api import resilient as resilient
from mnemojax._src.distributed.session import initialize as initialize
from mnemojax._src.options import CompileOptions as CompileOptions
from mnemojax._src.options import PersistentOptions as PersistentOptions
from mnemojax._src.options import RecoveryOptions as RecoveryOptions
from mnemojax._src.options import ResilienceOptions as ResilienceOptions
from mnemojax._src.options import SnapshotOptions as SnapshotOptions
from mnemojax._src.statistics import RecoveryRecord as RecoveryRecord
from mnemojax._src.statistics import Statistics as Statistics
from mnemojax._src.topology import MeshPlan as MeshPlan
from mnemojax._src.topology import plan_reduced_mesh as plan_reduced_mesh

__version__ = "0.1.0.dev0"

__all__ = [
    "CompileOptions",
    "MeshPlan",
    "PersistentOptions",
    "RecoveryOptions",
    "RecoveryRecord",
    "ResilienceOptions",
    "ResilientStep",
    "SnapshotOptions",
    "Statistics",
    "errors",
    "initialize",
    "plan_reduced_mesh",
    "resilient",
    "retry",
    "testing",
]
