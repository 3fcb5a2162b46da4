"""Shared test helpers: a tiny model, fixed batches, and the plain Flax/optax reference."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import mnemojax
from mnemojax.models.tasks import build_mlp, classification_loss, mlp_train_step

DIN, DHIDDEN, DOUT = 16, 64, 4
BATCH = 24  # divisible by 4, 3, 2, 1 data replicas (and 8)

# The test model's loss and train step: one definition, in mnemojax.models.tasks.
loss_fn = classification_loss
train_step = mlp_train_step


def printing_train_step(model, optimizer, batch):
    """`train_step` that prints its loss every step (`jax.debug.print`: a host callback,
    whose executables JAX writes to no persistent cache)."""
    metrics = train_step(model, optimizer, batch)
    jax.debug.print("mnemojax test job: loss {loss}", loss=metrics["loss"])
    return metrics


def noisy_train_step(model, optimizer, batch, key):
    """The test step on inputs jittered by a PRNG key folded with the optimizer's step
    count: a step whose math depends on a replicated key input (the Flax dropout guide's
    ``train_step(state, batch, dropout_key)`` pattern)."""
    noise = jax.random.normal(jax.random.fold_in(key, optimizer.step[...]), batch["x"].shape)
    return train_step(model, optimizer, {"x": batch["x"] + 0.1 * noise, "y": batch["y"]})


def make_mlp(seed: int = 0, dropout: float = 0.0):
    """The test MLP with Adam (1e-2)."""
    return build_mlp(seed=seed, din=DIN, dhidden=DHIDDEN, dout=DOUT, dropout=dropout)


def make_batches(n: int, seed: int = 0, batch: int = BATCH):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(batch, DIN)).astype(np.float32),
             "y": rng.integers(0, DOUT, size=(batch,)).astype(np.int32)} for _ in range(n)]


# The eval batch of the jobs' and tests' eval steps (`ResilientStep.guard`).
EVAL_BATCH = make_batches(1, seed=7)[0]


def reference_evals(batches) -> list[float]:
    """The loss on `EVAL_BATCH` after each of `batches` in the failure-free plain Flax run
    (one device)."""
    model, optimizer = make_mlp()
    step = nnx.jit(train_step)
    evaluate = nnx.jit(loss_fn)
    out = []
    for b in batches:
        step(model, optimizer, b)
        out.append(float(evaluate(model, EVAL_BATCH)))
    return out


def _host(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def host_state(model, optimizer) -> list[np.ndarray]:
    return [_host(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


@dataclasses.dataclass
class Run:
    losses: list[float]
    state: list[np.ndarray]


def reference_run(batches, *, dropout: float = 0.0, key_seed: int | None = None) -> Run:
    """The failure-free run, plain Flax + optax (no mnemojax), on one device; with
    `key_seed`, of `noisy_train_step` given ``jax.random.key(key_seed)`` every step."""
    model, optimizer = make_mlp(dropout=dropout)
    if key_seed is None:
        step = nnx.jit(train_step)
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    else:
        step, key = nnx.jit(noisy_train_step), jax.random.key(key_seed)
        losses = [float(step(model, optimizer, b, key)["loss"]) for b in batches]
    return Run(losses, host_state(model, optimizer))


def no_precompile(**kwargs) -> mnemojax.ResilienceOptions:
    """Options for tests: no background compiles, no persistent compilation cache."""
    kwargs.setdefault("compile", mnemojax.CompileOptions(precompile=False, cache_dir=None))
    return mnemojax.ResilienceOptions(**kwargs)


def resilient_run(batches, *, mesh, faults=None, options=None, spare_devices=(),
                  dropout: float = 0.0, settle: bool = False):
    """Runs `batches` through a resilient step. `settle` waits for each snapshot before the
    next step, so which source a recovery uses is deterministic."""
    model, optimizer = make_mlp(dropout=dropout)
    step = mnemojax.resilient(train_step, mesh=mesh, options=options or no_precompile(),
                              fault_injector=faults, spare_devices=spare_devices)
    try:
        losses = []
        for b in batches:
            losses.append(float(step(model, optimizer, b)["loss"]))
            if settle:
                step.wait_snapshots()
    finally:
        step.close()
    return Run(losses, host_state(model, optimizer)), step


def assert_same_run(got: Run, want: Run, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(got.losses, want.losses, rtol=tol, atol=tol)
    assert len(got.state) == len(want.state)
    for a, b in zip(got.state, want.state, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def assert_only_checkpoint_is_the_reference(ckpt, mesh_shape) -> int:
    """The one checkpoint of the test MLP in directory `ckpt` (a job's agreed stop
    checkpoint), restored through a resilient step on a mesh of `mesh_shape`, equals the
    failure-free plain run's state after its step; returns that step."""
    [saved] = [int(p.name) for p in Path(ckpt).iterdir() if p.name.isdigit()]
    model, optimizer = make_mlp()
    step = mnemojax.resilient(train_step, mesh=mesh_of(mesh_shape), options=no_precompile(
        persistent=mnemojax.PersistentOptions(directory=str(ckpt))))
    assert step.restore(model, optimizer) == saved
    step.close()
    assert_same_run(Run([], host_state(model, optimizer)),
                    Run([], reference_run(make_batches(saved)).state))
    return saved


def mesh_of(shape, names=("data", "model"), devices=None):
    devices = devices if devices is not None else jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def check_job_report(report: dict) -> dict:
    """A `run_scenario` report: every fault fired cleanly, and no process or shared-memory
    segment outlived the job."""
    from mnemojax._src.distributed.launcher.scenario import process_alive

    assert not report["unfired"], report["unfired"]
    assert not [f for f in report["fired"] if "error" in f], report["fired"]
    assert not any(process_alive(p) for p in report["pids"]), "a process outlived the job"
    assert report["shm_left"] == [], "shared memory outlived the job"
    return report


def assert_job_exact(out_dir, reference: Run, steps: int) -> dict:
    """A launched job's final state (``final.npz``, written by its process 0) equals the
    failure-free `reference`; returns its ``stats.json``."""
    final = np.load(os.path.join(out_dir, "final.npz"))
    for i, want in enumerate(reference.state):
        np.testing.assert_allclose(final[f"arr_{i}"], want, rtol=1e-5, atol=1e-5)
    with open(os.path.join(out_dir, "stats.json")) as f:
        stats = json.load(f)
    assert stats["steps_run"] == steps
    return stats


def plain_mesh_run(train_step, model, optimizer, batches, mesh, batch_spec) -> Run:
    """The plain ``nnx.jit`` run of `train_step` on `mesh` (state placed per its
    annotations, each batch placed with `batch_spec`): what a resilient run on that mesh
    must end equal to."""
    from jax.sharding import NamedSharding

    from mnemojax.models.tasks import shard_onto

    shard_onto(model, optimizer, mesh)
    step = nnx.jit(train_step)
    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, jax.device_put(
            b, NamedSharding(mesh, batch_spec)))["loss"]) for b in batches]
    return Run(losses, host_state(model, optimizer))


def run_two_processes(module: str, *args: str, timeout_s: float = 120.0) -> list[str]:
    """``python -m module PROCESS_ID COORDINATOR *args`` in two processes on a free loopback
    port (a `jax.distributed` job of the test's own), each bounded by ``timeout_s`` and
    ended here; fails naming both outputs unless both exit 0. Returns their outputs."""
    import os
    import subprocess
    import sys

    from mnemojax._src.distributed.transport import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", module, str(i), coordinator, *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs
