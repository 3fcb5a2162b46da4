"""Per-host data: each process reads only the rows of the global batch its devices hold,
and after a loss the survivors read the lost slices, so the global batch stays the same.

`HostBatches` wraps a random-access record source (a Grain ``MapDataset``, any sequence of
records); see `mnemojax._src.data` for the protocol other loaders follow.
"""

from mnemojax._src.data import HostBatches as HostBatches
from mnemojax._src.data import HostRows as HostRows
from mnemojax._src.data import RecordSource as RecordSource

__all__ = ["HostBatches", "HostRows", "RecordSource"]
