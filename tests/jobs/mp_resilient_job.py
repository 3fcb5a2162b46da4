"""A @mnemojax.resilient job for `mnemojax launch`: the MLP on a (processes x 2) mesh.

python -m mnemojax launch --nproc 3 --devices-per-proc 2 -- \
    python -m tests.jobs.mp_resilient_job --out DIR [--steps N] [--step-sleep-s S] \
    [--model-axis M] [--ckpt DIR --ckpt-every K] [--nan-at-step K] \
    [--transient-worker W --transient-at-step K] [--host-data] [--restore] [--in-series]
    [--key-seed S] [--guarded-eval [--eval-slow-after K] [--touch-before-eval]
    [--eval-on-host]]

Process 0 of the final world writes DIR/final.npz (the state, gathered) and
DIR/stats.json (the resilient step's statistics). A typed error ends a worker with exit
status 3 (MeshTooSmallError), 4 (StateUnavailableError) or 5 (BatchSplitError) and its
text in DIR/error-wI.txt.
"""

import argparse
import contextlib
import json
import os
import signal
import threading
import time
import warnings

import mnemojax

if os.environ.get("MNEMOJAX_SPARE") == "1":  # a spare slow to get ready (tests: a world
    time.sleep(float(os.environ.get("MP_JOB_SPARE_DELAY_S", "0")))  # decided before it is)
session = mnemojax.initialize()  # joins the launcher's world: before any JAX use

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mnemojax._src.chaos_worker import finish_job  # noqa: E402
from tests import helpers as h  # noqa: E402

EXIT_CODES = {"MeshTooSmallError": 3, "StateUnavailableError": 4, "BatchSplitError": 5}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--step-sleep-s", type=float, default=0.2)
    parser.add_argument("--pause-after", type=int, default=-1, metavar="K",
                        help="every process spends --pause-s seconds in its own code after "
                             "step K (a long eval, a slow save: no step runs meanwhile)")
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--user-ckpt", default=None, metavar="DIR",
                        help="the job's own Orbax CheckpointManager (async, every "
                             "--user-ckpt-every steps) beside mnemojax's, as the README says "
                             "to keep one: made again when step.mesh changes, saved through "
                             "step.guard, with mnemojax.checkpoint_barrier()")
    parser.add_argument("--user-ckpt-every", type=int, default=3)
    parser.add_argument("--die-in-save", type=int, default=-1, metavar="W",
                        help="with --user-ckpt: worker W SIGKILLs itself in its save after "
                             "step --die-in-save-at, past the save's collective, as it comes "
                             "to the save's first barrier (the others wait for it there, on "
                             "their main thread)")
    parser.add_argument("--die-in-save-at", type=int, default=-1, metavar="K")
    parser.add_argument("--die-before-save", type=int, default=-1, metavar="W",
                        help="worker W kills itself (SIGKILL) as its guarded own save after "
                             "step --die-before-save-at starts, before Orbax's first "
                             "barrier (the others meet the death in that barrier)")
    parser.add_argument("--die-before-save-at", type=int, default=-1, metavar="K")
    parser.add_argument("--late-saver", type=int, default=-1, metavar="W",
                        help="with --user-ckpt: worker W spends 1 s in its own code before "
                             "its (guarded) save after step --late-save-at")
    parser.add_argument("--late-save-at", type=int, default=-1, metavar="K")
    parser.add_argument("--die-in-commit", action="store_true",
                        help="with --die-in-save: W dies at the first barrier of that save's "
                             "commit (Orbax's thread) instead, once every process has "
                             "gathered the final state (the others' commits wait for it, "
                             "and the job ends without a new world)")
    parser.add_argument("--long-eval-after", type=int, default=-1, metavar="K",
                        help="after step K every process dispatches --long-eval-calls calls "
                             "of a jitted eval (200 losses on a batch placed over the data "
                             "axis: collectives across the processes) without waiting, then "
                             "waits for their sum (a user trial's long eval, session 16)")
    parser.add_argument("--long-eval-calls", type=int, default=70)
    parser.add_argument("--poll-thread", action="store_true",
                        help="a thread of the user's asks jax.process_index() every 0.5 ms "
                             "throughout (a logger, or Orbax's save thread), also while a "
                             "recovery re-initialises jax.distributed")
    parser.add_argument("--model-axis", type=int, default=2, help="mesh (n / M, M)")
    parser.add_argument("--ckpt", default=None, help="persistent tier directory")
    parser.add_argument("--nan-at-step", type=int, default=-1,
                        help="feed a NaN batch before this step (nonfinite='skip_batch')")
    parser.add_argument("--transient-worker", type=int, default=-1,
                        help="this worker's step ... fails once with a retryable error")
    parser.add_argument("--transient-at-step", type=int, default=-1, help="... at this step")
    parser.add_argument("--raise-worker", type=int, default=-1,
                        help="this worker raises a RuntimeError (a user bug) ...")
    parser.add_argument("--raise-at-step", type=int, default=-1, help="... before this step")
    parser.add_argument("--ckpt-every", type=int, default=0,
                        help="Orbax checkpoint every N steps (with --ckpt)")
    parser.add_argument("--host-data", action="store_true",
                        help="per-host batches: a Grain dataset of the same examples through "
                             "mnemojax.data.HostBatches; each process reads only its rows and "
                             "writes the count per step to DIR/rows-wI.json")
    parser.add_argument("--precompile-cache", default=None, metavar="DIR",
                        help="compile the next worlds ahead, with JAX's persistent "
                             "compilation cache in DIR (default: neither)")
    parser.add_argument("--ahead-losses", type=int, default=1,
                        help="CompileOptions(ahead_losses=N), with --precompile-cache")
    parser.add_argument("--no-held-replicas", action="store_true",
                        help="SnapshotOptions(hold_live_replicas=False): a lost state comes "
                             "from the snapshots alone")
    parser.add_argument("--in-series", action="store_true",
                        help="SnapshotOptions(replicate_in_series=True): each step returns "
                             "once the buddy holds its snapshot")
    parser.add_argument("--min-devices", type=int, default=1, metavar="N",
                        help="RecoveryOptions(min_devices=N)")
    parser.add_argument("--run-recoveries", type=int, default=None, metavar="N",
                        help="RecoveryOptions(run_stop=stop_after_attempt(N)): at most N "
                             "recoveries charged to the run")
    parser.add_argument("--key-seed", type=int, default=None, metavar="S",
                        help="train tests.helpers.noisy_train_step, given jax.random.key(S) "
                             "every step (a replicated key input)")
    parser.add_argument("--debug-print", action="store_true",
                        help="train tests.helpers.printing_train_step (a host callback)")
    parser.add_argument("--global-array-batch", action="store_true",
                        help="pass the batch as a jax.Array built from each process's own "
                             "rows (jax.make_array_from_process_local_data)")
    parser.add_argument("--tally-between", action="store_true",
                        help="the step also counts its calls in a carried tally, which the "
                             "loop resets before each step (a metrics reset between steps; "
                             "not in the final state)")
    parser.add_argument("--rewrite-between", action="store_true",
                        help="before each step, put an equal copy of model.l1.bias in its "
                             "variable (outside the step, as a jitted call writing back)")
    parser.add_argument("--key-per-process", action="store_true",
                        help="with --key-seed: seed S + this worker's id, another key in each "
                             "process (a mistake the step must refuse)")
    parser.add_argument("--guarded-eval", action="store_true",
                        help="after each step, evaluate on tests.helpers.EVAL_BATCH placed "
                             "over the data axis (a collective across the processes) through "
                             "step.guard; writes DIR/evals-wI.json (step -> loss, null "
                             "where GuardSkippedError skipped it)")
    parser.add_argument("--eval-first", action="store_true",
                        help="with --guarded-eval: the loop evaluates before each step "
                             "(the eval after step k - 1, at iteration k) instead of after")
    parser.add_argument("--eval-slow-after", type=int, default=-1, metavar="K",
                        help="with --guarded-eval: the first eval after step K sleeps 2 s "
                             "before it starts (a kill at K lands inside it)")
    parser.add_argument("--die-in-eval", type=int, default=-1, metavar="W",
                        help="with --guarded-eval: worker W SIGKILLs itself 1 s into its "
                             "eval after step --die-in-eval-at, before it dispatches it (the "
                             "others wait for it in their eval's collective)")
    parser.add_argument("--die-in-eval-at", type=int, default=-1, metavar="K")
    parser.add_argument("--untraceable-mesh", default="", metavar="DxM[,DxM...]",
                        help="the step's trace fails on a (data D, model M) mesh (as one "
                             "that splits its batch into micro-batches by its width)")
    parser.add_argument("--withhold-publish", type=int, default=-1, metavar="W",
                        help="worker W does not hand its snapshot of step "
                             "--withhold-publish-at to its agent (the agents' copies of "
                             "that step are incomplete: a loss of W then agrees on the step "
                             "before it)")
    parser.add_argument("--withhold-publish-at", type=int, default=-1, metavar="K")
    parser.add_argument("--touch-before-eval", action="store_true",
                        help="with --guarded-eval: replace the optimizer's step count by an "
                             "equal new array before each eval (the guard compares the "
                             "state with the step's by value then)")
    parser.add_argument("--eval-on-host", action="store_true",
                        help="with --guarded-eval: the eval takes the host batch (each "
                             "process computes the whole loss: no collective across them), "
                             "and with --eval-slow-after only worker 0 sleeps, before it "
                             "calls the guarded eval (it meets the death there, the others "
                             "in their next step)")
    parser.add_argument("--restore", action="store_true",
                        help="step.restore() first and start the loop at the step it returns "
                             "(a worker the launcher restarts into the running job needs it)")
    args = parser.parse_args()
    me = session.world.stable_id if session is not None else 0
    polling = threading.Event()
    if args.poll_thread:
        poller = threading.Thread(target=_poll_process_index, args=(polling,), daemon=True)
        polling.set()
        poller.start()
    if me == args.withhold_publish and session is not None:
        _withhold_publish(session, args.withhold_publish_at)
    mesh = h.mesh_of((jax.device_count() // args.model_axis, args.model_axis))
    model, optimizer = h.make_mlp()
    events = os.path.join(args.out, f"mnemojax-events-w{me}.jsonl")
    faults = None
    if me == args.transient_worker:
        faults = mnemojax.testing.FaultInjector().transient_error(args.transient_at_step)
    extra_opts = {} if args.precompile_cache is None else {
        "compile": mnemojax.CompileOptions(precompile=True, cache_dir=args.precompile_cache,
                                           ahead_losses=args.ahead_losses)}
    recovery = {"min_devices": args.min_devices}
    if args.run_recoveries is not None:
        recovery["run_stop"] = mnemojax.retry.stop_after_attempt(args.run_recoveries)
    extra_opts["recovery"] = mnemojax.RecoveryOptions(**recovery)
    if args.no_held_replicas or args.in_series:
        extra_opts["snapshot"] = mnemojax.SnapshotOptions(
            hold_live_replicas=not args.no_held_replicas, replicate_in_series=args.in_series)
    train_step = h.train_step if args.key_seed is None else h.noisy_train_step
    if args.debug_print:
        train_step = h.printing_train_step
    if args.untraceable_mesh:
        train_step = _untraceable_on(train_step, {
            tuple(int(n) for n in shape.split("x")) for shape in args.untraceable_mesh.split(",")})
    seed = None if args.key_seed is None else args.key_seed + me * args.key_per_process
    inputs = () if seed is None else (jax.random.key(seed),)
    tally = None
    if args.tally_between:
        tally = _Tally()
        inputs, train_step = (tally, *inputs), _tallied(train_step)
    step = mnemojax.resilient(train_step, mesh=mesh, fault_injector=faults,
                              options=h.no_precompile(
                                  event_log=events, run_name=f"w{me}",
                                  nonfinite="raise" if args.host_data else "skip_batch",
                                  persistent=mnemojax.PersistentOptions(
                                      directory=args.ckpt, every_steps=args.ckpt_every),
                                  **extra_opts))
    start = step.restore(model, optimizer) if args.restore else 0
    evaluate, evals = _guarded_eval(step, args.eval_slow_after, args.eval_on_host,
                                    args.die_in_eval_at if me == args.die_in_eval else None), {}
    die_at = args.die_in_save_at if me == args.die_in_save else None
    gathered = threading.Event()  # (--die-in-commit: the final state is gathered)
    user_save, user_manager = (_user_checkpoints(step, args.user_ckpt, args.user_ckpt_every,
                                                 die_at, gathered if args.die_in_commit
                                                 else None,
                                                 die_before=args.die_before_save_at
                                                 if me == args.die_before_save else None)
                               if args.user_ckpt else (None, None))
    loader = None
    if args.host_data:
        import grain  # noqa: PLC0415

        records = [{"x": b["x"][i], "y": b["y"][i]}
                   for b in h.make_batches(args.steps) for i in range(h.BATCH)]
        loader = mnemojax.data.HostBatches(grain.MapDataset.source(records), h.BATCH,
                                           start=start)
        batches = enumerate(loader, start=start + 1)
    else:
        batches = enumerate(h.make_batches(args.steps), start=1)
    def _evaluate_after(k: int) -> None:
        if args.eval_on_host and k == args.eval_slow_after and me == 0:
            time.sleep(2.0)
        if args.touch_before_eval:
            optimizer.step[...] = optimizer.step[...] + 0
        try:
            evals[k] = float(evaluate(model, h.EVAL_BATCH)["loss"])
        except mnemojax.errors.GuardSkippedError as exc:  # spares joined: no eval
            print(f"mnemojax job: eval after step {k} skipped: {exc}", flush=True)
            evals[k] = None

    for k, batch in batches:
        if k <= start:
            continue
        if k == args.nan_at_step and loader is None:  # every process: the same global batch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mnemojax.errors.NonFiniteSkipWarning)
                step(model, optimizer, {"x": np.full_like(batch["x"], np.nan),
                                        "y": batch["y"]})
        if tally is not None:
            tally.calls.set_value(jnp.zeros((), jnp.int32))
        if args.rewrite_between:
            model.l1.bias.set_value(jnp.copy(model.l1.bias.get_value()))
        if k == args.raise_at_step and me == args.raise_worker:
            raise RuntimeError(f"user bug in worker {me} at step {k}")
        if args.guarded_eval and args.eval_first and k > 1:
            _evaluate_after(k - 1)
        if args.global_array_batch:  # as MaxText does: each process gives its own rows
            rows = jax.sharding.NamedSharding(mesh, jax.P(mesh.axis_names[0]))
            n = h.BATCH // jax.process_count()
            batch = {k: jax.make_array_from_process_local_data(
                rows, v[jax.process_index() * n:(jax.process_index() + 1) * n], v.shape)
                for k, v in batch.items()}
        try:
            step(model, optimizer, batch, *inputs)
        except (mnemojax.errors.MeshTooSmallError, mnemojax.errors.StateUnavailableError,
                mnemojax.errors.BatchSplitError) as exc:
            print(f"mnemojax job: {type(exc).__name__}: {exc}", flush=True)
            code = EXIT_CODES[type(exc).__name__]
            with open(os.path.join(args.out, f"error-w{me}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            raise SystemExit(code) from exc
        if k == args.long_eval_after:
            _long_eval(step, model, args.long_eval_calls, me)
        if user_save is not None:
            if me == args.late_saver and k == args.late_save_at:
                time.sleep(1.0)
            try:
                user_save(k, model, optimizer)
            except mnemojax.errors.GuardSkippedError as exc:  # (the README: catch it)
                print(f"mnemojax job: w{me}: the save after step {k} skipped: {exc}",
                      flush=True)
        if args.guarded_eval and not args.eval_first:
            _evaluate_after(k)
        time.sleep(args.pause_s if k == args.pause_after else args.step_sleep_s)

    def last_commit() -> None:
        gathered.set()
        try:
            user_manager().wait_until_finished()
        except mnemojax.errors.CheckpointLostError as exc:  # (the README: catch it)
            print(f"mnemojax job: w{me}: the last checkpoint was lost: {exc}", flush=True)

    if user_manager is not None and not args.die_in_commit:
        user_manager().wait_until_finished()
    if polling.is_set():  # (a daemon thread in jaxlib at exit aborts the process)
        polling.clear()
        poller.join(timeout=10)
    if args.guarded_eval:
        with open(os.path.join(args.out, f"evals-w{me}.json"), "w") as f:
            json.dump(evals, f)
    if loader is not None:
        with open(os.path.join(args.out, f"rows-w{me}.json"), "w") as f:
            json.dump({str(k): n for k, n in sorted(loader.rows_read.items())}, f)
    finish_job(args.out, nnx.state((model, optimizer)), step, session,
               before_close=last_commit if args.die_in_commit else None)


def _untraceable_on(train_step, shapes: set[tuple[int, ...]]):
    """`train_step`, whose trace fails on a (data, model) mesh of one of `shapes`."""
    def step(*args):
        mesh = jax.sharding.get_abstract_mesh().shape
        if (mesh.get("data"), mesh.get("model")) in shapes:
            raise ValueError(f"the batch does not split into micro-batches for "
                             f"{mesh.get('data')} replicas")
        return train_step(*args)
    return step


def _withhold_publish(session, at: int) -> None:
    """This worker's snapshot of step `at` never reaches its agent (nor its buddy)."""
    publish = session.publish

    def withheld(step_, leaves, **kw):
        if step_ == at:
            print(f"mnemojax job: the snapshot of step {at} withheld", flush=True)
            return True
        return publish(step_, leaves, **kw)

    session.publish = withheld


class _Tally(nnx.Module):
    """Calls counted since the loop last reset it (as training metrics are)."""

    def __init__(self):
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))


def _tallied(train_step):
    """`train_step` that also counts its call in a carried `_Tally`."""
    def step(model, optimizer, batch, tally, *inputs):
        tally.calls.set_value(tally.calls.get_value() + 1)
        return train_step(model, optimizer, batch, *inputs)
    return step


def _user_checkpoints(step, directory: str, every: int, die_at: int | None,
                      in_commit: threading.Event | None, *, die_before: int | None = None):
    """The user's own Orbax checkpoints across processes (README, "Your own Orbax
    checkpoints"): a manager per world (Orbax keeps the distributed client it was made
    with), the barrier that gives up on a peer's death, the save guarded (it starts with a
    collective across the processes). ``die_at``: this process kills itself (SIGKILL) as
    it comes to the first barrier of its save after that step; with ``in_commit``, to the
    first one of that step's commit (Orbax's thread; its keys end in ``.<step>``), once
    ``in_commit`` is set. ``die_before``: it kills itself as its save after that step
    starts, before any barrier."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    made: dict = {"mesh": None, "manager": None, "saving": None}

    def barrier_sync_fn():
        barrier = mnemojax.checkpoint_barrier()

        def dying_barrier(*, key: str, timeout_ms: int) -> None:
            on_commit_thread = threading.current_thread() is not threading.main_thread()
            if (key.endswith(f".{die_at}") and on_commit_thread if in_commit is not None
                    else made["saving"] == die_at and not on_commit_thread):
                if in_commit is not None:
                    in_commit.wait(timeout=120)
                print(f"mnemojax job: killing myself at barrier {key}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            barrier(key=key, timeout_ms=timeout_ms)
        return dying_barrier if die_at is not None else barrier

    def manager():
        if made["mesh"] is not step.mesh:  # a new world: the old manager is let go
            made["manager"] = ocp.CheckpointManager(
                directory, options=ocp.CheckpointManagerOptions(
                    save_interval_steps=every, max_to_keep=2,
                    async_options=ocp.AsyncOptions(barrier_sync_fn=barrier_sync_fn())))
            made["mesh"] = step.mesh
        return made["manager"]

    @step.guard
    def save(k, model, optimizer):
        if k == die_before:
            print(f"mnemojax job: killing myself before the save after step {k}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if manager().should_save(k):
            made["saving"] = k  # (the commit of the step saved last)
        manager().save(k, args=ocp.args.StandardSave(nnx.state((model, optimizer))))

    return save, manager


def _long_eval(step, model, calls: int, me: int) -> None:
    @nnx.jit
    def evaluate(model, batch):
        def body(i, acc):
            x = batch["x"] * (1.0 + 1e-3 * i)
            return acc + h.loss_fn(model, {"x": x, "y": batch["y"]})
        return jax.lax.fori_loop(0, 200, body, jnp.zeros((), jnp.float32)) / 200.0

    rows = h.make_batches(1, seed=11, batch=240)[0]
    t0 = time.perf_counter()
    with jax.set_mesh(step.mesh):
        batch, total = step.place(rows), jnp.zeros((), jnp.float32)
        for i in range(calls):
            total = total + evaluate(model, batch)
            if i % 10 == 9:
                print(f"mnemojax job: w{me} long eval: {i + 1} calls dispatched at "
                      f"+{time.perf_counter() - t0:.1f} s", flush=True)
        print(f"mnemojax job: w{me} long eval: {float(total) / calls:.6f} after "
              f"{time.perf_counter() - t0:.1f} s", flush=True)


def _poll_process_index(polling: threading.Event) -> None:
    while polling.is_set():
        with contextlib.suppress(Exception):  # a user's logger carries on
            jax.process_index()
        time.sleep(0.0005)


def _guarded_eval(step, slow_after: int, on_host: bool, die_at: int | None):
    """The eval a user writes beside the train step: the batch placed over the data axis
    of the step's current mesh at each call (`ResilientStep.place`), the loss a mean
    across processes (or, with `on_host`, the host batch: the whole loss in every
    process). ``die_at``: this process kills itself 1 s into its eval after that step."""
    loss = nnx.jit(lambda model, batch: {"loss": h.loss_fn(model, batch)})
    slept = []

    @step.guard
    def evaluate(model, batch):
        if step.step_count == die_at:
            time.sleep(1.0)
            print(f"mnemojax job: killing myself in the eval after step {die_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if on_host:
            return loss(model, batch)
        if step.step_count == slow_after and not slept:
            slept.append(True)
            time.sleep(2.0)
        with jax.set_mesh(step.mesh):  # (step.place: no collective, unlike device_put)
            return loss(model, step.place(batch))

    return evaluate


if __name__ == "__main__":
    main()
