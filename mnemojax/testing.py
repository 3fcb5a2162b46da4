"""Rehearse failures: fault injection that surfaces like real hardware faults."""

from mnemojax._src.fault_injection import FaultInjector as FaultInjector
from mnemojax._src.fault_injection import InjectedFault as InjectedFault

__all__ = ["FaultInjector", "InjectedFault"]
