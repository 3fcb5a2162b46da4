"""Rehearse failures: fault injection that surfaces like real hardware faults.

In one process, `FaultInjector` makes devices fail, hang or return transient errors below
the resilient step. Across processes, `run_scenario` runs a job under the launcher and does
`ProcessFault` s to its workers from outside (kill, whole host, hang, corrupt shared-memory
copy, a kill during the agreement); `corrupt_agent_copies` flips a bit in an agent's
shared-memory snapshots.
"""

from mnemojax._src.distributed.launcher.scenario import ProcessFault as ProcessFault
from mnemojax._src.distributed.launcher.scenario import corrupt_agent_copies as corrupt_agent_copies
from mnemojax._src.distributed.launcher.scenario import run_scenario as run_scenario
from mnemojax._src.fault_injection import FaultInjector as FaultInjector
from mnemojax._src.fault_injection import InjectedFault as InjectedFault

__all__ = ["FaultInjector", "InjectedFault", "ProcessFault", "corrupt_agent_copies",
           "run_scenario"]
