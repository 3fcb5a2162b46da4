"""The typed error hierarchy. Every error mnemojax raises derives from `MnemojaxError`."""

from __future__ import annotations

from collections.abc import Sequence


class MnemojaxError(Exception):
    """Root of every error raised by mnemojax."""


class MnemojaxWarning(UserWarning):
    """Root of every warning issued by mnemojax (tests turn these into errors)."""


class MathChangedWarning(MnemojaxWarning):
    """A recovery policy changed the math of the step (for example fewer examples per step)."""


class NonFiniteSkipWarning(MnemojaxWarning):
    """A batch was skipped because the step produced NaN/Inf (nonfinite="skip_batch")."""


class LossCheckWarning(MnemojaxWarning):
    """The non-finite policy found no scalar loss in the step's metrics (``loss_key``):
    only the new state is checked for NaN/Inf. Not issued for a step that returns nothing
    (or, pure, its state alone): it has no loss to find."""


class SnapshotBudgetWarning(MnemojaxWarning):
    """The snapshot buffers would exceed the host-memory budget; snapshots are off."""


class InvalidOptionError(MnemojaxError, ValueError):
    """An option or argument has a value outside its legal range."""


class UnsupportedStateError(MnemojaxError, TypeError):
    """The step's state is neither a Flax NNX model/optimizer pair nor a pytree of arrays."""


class ShardingMismatchError(MnemojaxError, ValueError):
    """Sharding annotations name mesh axes that the mesh does not have, or do not divide."""


class BatchSplitError(MnemojaxError, ValueError):
    """The step's inputs cannot be split or placed as given: a global batch the data axes
    cannot split evenly, a replicated input that differs between processes, or a
    `jax.Array` over other processes' devices."""


class StepHangError(MnemojaxError):
    """A step's results were not ready within the hang timeout; its devices are probed."""

    def __init__(self, message: str, *, step: int, timeout_s: float):
        super().__init__(message)
        self.step = step
        self.timeout_s = timeout_s


class DeviceFailureError(MnemojaxError):
    """One or more devices failed while running a step.

    Attributes:
        failed_devices: ids of the devices found dead.
        step: the step that was running when the failure surfaced.
    """

    def __init__(self, message: str, *, failed_devices: Sequence[int], step: int):
        super().__init__(message)
        self.failed_devices = tuple(failed_devices)
        self.step = step


class MeshTooSmallError(MnemojaxError):
    """Too few healthy devices remain to hold the model (or the configured minimum)."""

    def __init__(self, message: str, *, healthy_devices: int, required: int):
        super().__init__(message)
        self.healthy_devices = healthy_devices
        self.required = required


class StepCompileError(MnemojaxError):
    """The step cannot be compiled for the mesh a recovery needs (it traced or compiled on
    the first mesh). Raised from the recovery, with the cause chained; where a mesh of
    that shape was compiled ahead of time, that failed the same way and was logged then,
    before any fault.

    Attributes:
        mesh_shape: the recovery's mesh, axis name -> size.
    """

    def __init__(self, message: str, *, mesh_shape: dict[str, int]):
        super().__init__(message)
        self.mesh_shape = dict(mesh_shape)


class RecoveryExhaustedError(MnemojaxError):
    """The recovery or retry budget ran out.

    Attributes:
        attempts: how many recoveries/retries were made for the failing step.
        last_error: the exception that the last attempt ended with.
    """

    def __init__(self, message: str, *, attempts: int, last_error: BaseException | None):
        super().__init__(message)
        self.attempts = attempts
        self.last_error = last_error


class GuardSkippedError(MnemojaxError):
    """Guarded work (`ResilientStep.guard`) met a failure and the training state was
    recovered, but the new world has processes that joined it (spares, a world grown
    back), or survivors that had passed the work and met the failure in the next step:
    they go on at the next step, so the work (whose collectives need every process) does
    not run again. Catch it to skip that work; the next step goes on.

    Attributes:
        after_step: the step the work ran after.
        joined: the worker ids that joined the new world (none where survivors were past
            the work).
    """

    def __init__(self, message: str, *, after_step: int, joined: tuple[int, ...]):
        super().__init__(message)
        self.after_step = after_step
        self.joined = joined


class SnapshotCorruptError(MnemojaxError):
    """A snapshot failed its CRC32C check, or changed while it was read; it is never
    restored.

    Raised for this process's host snapshots and for the copies an agent holds for the
    multi-process layer (its shared-memory slots, its buddy replicas, a fetched copy).
    """


class StateUnavailableError(MnemojaxError):
    """No complete copy of the state survives (no live replica and no usable snapshot).

    Across processes: no live agent holds a verified copy of some shard of the agreed
    step, or the copies fetched mix steps or leave part of a leaf uncovered.

    Attributes:
        corrupt: snapshots that were there but failed their checksums.
    """

    def __init__(self, message: str, *, corrupt: int = 0):
        super().__init__(message)
        self.corrupt = corrupt


class NonFiniteLossError(MnemojaxError, FloatingPointError):
    """The step produced a NaN or Inf loss; the state of the previous step is kept."""

    def __init__(self, message: str, *, step: int, value: float):
        super().__init__(message)
        self.step = step
        self.value = value


class CheckpointMismatchError(MnemojaxError, ValueError):
    """A persistent checkpoint (or snapshot) belongs to another model."""


class CheckpointSaveError(MnemojaxError):
    """A persistent checkpoint could not be written (disk full, no permission, ...).

    Raised at the start of the first call after the failure is known, before that call
    does anything, or by `close()`; each failure once. The training state is not touched
    by a checkpoint's failure: the step counter, the model and the committed checkpoints
    stay as they were, so calling again with the same arguments continues the run exactly
    as if no save had failed; the steps named are just not checkpointed (the next
    scheduled save tries again). The Orbax error is the ``__cause__``.

    Attributes:
        steps: the steps whose checkpoints failed, oldest first.
        step: the newest of them.
        directory: the checkpoint directory.
    """

    def __init__(self, message: str, *, steps: Sequence[int], directory: str):
        super().__init__(message)
        self.steps = tuple(steps)
        self.step = self.steps[-1]
        self.directory = directory


class CheckpointLostError(MnemojaxError):
    """A checkpoint given up because a peer process of its world died, or the world ended,
    before it was committed (`mnemojax.checkpoint_barrier`, mnemojax's own checkpoints
    across processes). Raised to Orbax, which raises it from a user's own manager's
    ``wait_until_finished()`` or next ``save``; mnemojax's own checkpoints log it instead
    (the step recovers the world, the next checkpoint is written)."""


class CheckpointCorruptError(MnemojaxError, ValueError):
    """No checkpoint in the directory can be read (each was tried, newest first).

    Attributes:
        directory: the checkpoint directory.
        steps: the checkpoints tried, newest first.
        errors: per step tried, the error its restore ended with.
    """

    def __init__(self, message: str, *, directory: str, steps: Sequence[int],
                 errors: Sequence[BaseException]):
        super().__init__(message)
        self.directory = directory
        self.steps = tuple(steps)
        self.errors = tuple(errors)


class DistributedError(MnemojaxError):
    """Root of the errors of the multi-process layer (launcher, agents, world
    re-initialisation); also raised directly when it is used out of order, e.g.
    `mnemojax.initialize` after JAX's backend has started."""


class UnsupportedJaxVersionError(DistributedError):
    """The installed JAX is outside the range whose private APIs the multi-process layer
    was checked on.

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
    """A peer sent a malformed or unexpected message on a loopback control connection, or
    answered a request with an error.

    Attributes:
        op: the message kind concerned (None when the frame itself is malformed).
        field: the field that is missing or of the wrong type (None when not one field).
    """

    def __init__(self, message: str, *, op: str | None = None, field: str | None = None):
        super().__init__(message)
        self.op = op
        self.field = field


class AgreementError(DistributedError):
    """The survivors could not agree on a live set and a resume step.

    Attributes:
        generation: the world generation the agreement was attempted for.
    """

    def __init__(self, message: str, *, generation: int):
        super().__init__(message)
        self.generation = generation


class SimulationConfigError(InvalidOptionError):
    """A simulator parameter is outside its legal range (the message names value and range)."""


class BaselineError(MnemojaxError, RuntimeError):
    """A benchmark's classical-baseline worker failed other than by the injected kill, or
    ran past its deadline.

    Attributes:
        returncode: the worker's exit status (negative: killed by that signal).
        stderr_tail: the end of its stderr.
    """

    def __init__(self, message: str, *, returncode: int | None, stderr_tail: str):
        super().__init__(f"{message}\n--- worker stderr (tail) ---\n{stderr_tail}")
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class _CleanExit(SystemExit):
    """An exit with status 0 that says why (``str()``): an end mnemojax chose, no error."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionExit(_CleanExit):
    """Raised from a step after a preemption notice, once the persistent checkpoint of the
    last complete step is committed. Exits the process with status 0 unless caught.

    Attributes:
        step: the step saved.
        directory: the checkpoint directory.
    """

    def __init__(self, message: str, *, step: int, directory: str):
        super().__init__(message)
        self.step = step
        self.directory = directory


class LeftJobExit(_CleanExit):
    """This process has left the job, whose other processes go on without it. Exits the
    process with status 0 unless caught; a later step raises it again. Raised:

    * from a step, when a recovery leaves the process with no device of the new mesh
      (e.g. a model replica spans two processes and three survive);
    * from ``step.restore()`` in a process that joined a running job (a spare, or a worker
      restarted after its world's coordination service died), when no holder of an
      agreed copy answers with a good one (they died since it joined, or their copies
      fail their checks).

    Attributes:
        step: the step that failed, or for a process that joined, the agreed step it was
            to resume from.
        generation: the world it left.
    """

    def __init__(self, message: str, *, step: int, generation: int):
        super().__init__(message)
        self.step = step
        self.generation = generation
