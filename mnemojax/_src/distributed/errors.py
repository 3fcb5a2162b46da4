"""Typed errors of the multi-process layer (all derive from `MnemojaxError`)."""

from __future__ import annotations

from mnemojax._src.errors import MnemojaxError


class DistributedError(MnemojaxError):
    """Root of the errors raised by `mnemojax._src.distributed`."""


class UnsupportedJaxVersionError(DistributedError):
    """The installed JAX is outside the range whose private APIs this package was checked on.

    Attributes:
        version: the installed `jax.__version__`.
        supported: the supported range, as text.
    """

    def __init__(self, message: str, *, version: str, supported: str):
        super().__init__(message)
        self.version = version
        self.supported = supported


class WorldConfigError(DistributedError, ValueError):
    """The environment does not describe a valid world (coordinator, process id, count)."""


class ProtocolError(DistributedError):
    """A peer sent a malformed or unexpected message on a loopback control connection."""


class ChecksumError(DistributedError):
    """A snapshot payload failed its CRC32 check (torn read, corrupt copy)."""


class SnapshotUnavailableError(DistributedError):
    """No agent holds a complete copy of the requested (rank, step) snapshot."""


class AgreementError(DistributedError):
    """The survivors could not agree on a live set and a resume step.

    Attributes:
        generation: the world generation the agreement was attempted for.
    """

    def __init__(self, message: str, *, generation: int):
        super().__init__(message)
        self.generation = generation
