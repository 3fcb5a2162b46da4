"""A program in the shape of google/flax examples/gemma's training loop: the step takes
``(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id)`` under nnx.jit's
conventions, with dropout drawing from the Rngs and an nnx.MultiMetric updated in place.

Its own code (not the example's files): a tiny token model with FSDP/TP-style partition
annotations. Run through two device losses, it matches the plain nnx.jit run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

VOCAB, D, SEQ, BATCH, STEPS = 32, 16, 8, 24, 6
PAD = 0


class TinyLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs,
                               embedding_init=nnx.with_partitioning(init, (None, "model")))
        self.hidden = nnx.Linear(D, 2 * D, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.out = nnx.Linear(2 * D, VOCAB, rngs=rngs,
                              kernel_init=nnx.with_partitioning(init, ("model", None)))
        self.dropout = nnx.Dropout(0.2)

    def __call__(self, tokens, rngs: nnx.Rngs):
        x = self.dropout(self.embed(tokens), rngs=rngs)
        return self.out(nnx.gelu(self.hidden(x)))


def train_step(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id):
    """The example's signature; the body is this project's."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    mask = (targets != pad_id).astype(jnp.float32)

    def loss_fn(model, rngs):
        logits = model(inputs, rngs)
        labels = optax.smooth_labels(jax.nn.one_hot(targets, VOCAB), label_smoothing)
        per_token = optax.softmax_cross_entropy(logits, labels)
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, rngs)
    optimizer.update(model, grads)
    metrics.update(loss=loss, logits=logits.reshape(-1, VOCAB), labels=targets.reshape(-1))
    return {"loss": loss, "tokens": jnp.sum(mask)}


def make_program():
    with nnx.use_eager_sharding(False):
        model = TinyLM(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=7)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())
    return model, optimizer, rngs, metrics


def make_batches(n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        tokens[:, -2:] = PAD  # padded tails
        out.append({"tokens": tokens})
    return out


def _host(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)]


def run(step, batches):
    model, optimizer, rngs, metrics = make_program()
    outs, states = [], []
    for b in batches:
        outs.append(step(model, optimizer, rngs, b, metrics, 0.1, PAD))
        states.append(_host(nnx.state((model, optimizer, rngs))))
    return {"states": states,"losses": [float(o["loss"]) for o in outs],
            "tokens": [float(o["tokens"]) for o in outs],
            "state": _host(nnx.state((model, optimizer))),
            "rng_count": int(rngs.dropout.count.get_value()),
            "rng_key": _host(rngs.dropout.key.get_value()),
            "metrics": {k: float(v) for k, v in metrics.compute().items()}}


@pytest.fixture(scope="module")
def reference():
    return run(nnx.jit(train_step), make_batches())


@pytest.fixture(scope="module")
def recovered():
    faults = FaultInjector().lose_devices(2, [3]).lose_devices(4, [5], surface="block")
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults)
    try:
        yield run(step, make_batches()), step
    finally:
        step.close()


def test_two_device_losses_end_with_the_plain_runs_state(recovered, reference):
    got, step = recovered
    assert len(step.statistics.recoveries) == 2
    assert step.mesh is not None and 3 not in step.mesh.device_ids and 5 not in step.mesh.device_ids
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
    assert len(got["state"]) == len(reference["state"])
    for a, b in zip(got["state"], reference["state"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_metrics_and_rng_streams_continue_exactly(recovered, reference):
    got, _ = recovered
    assert got["rng_count"] == reference["rng_count"] == STEPS
    for a, b in zip(got["rng_key"], reference["rng_key"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["metrics"].keys() == reference["metrics"].keys()
    for k, v in reference["metrics"].items():
        np.testing.assert_allclose(got["metrics"][k], v, rtol=1e-5, atol=1e-6)
    assert got["tokens"] == reference["tokens"]  # return values as the step returns them


def test_the_step_carries_every_nnx_object_as_state(recovered):
    _, step = recovered
    form = step._built.form  # noqa: SLF001 - what got carried, by name
    tops = {key[0] for key in form.leaf_keys}
    assert tops == {"model", "optimizer", "rngs", "metrics"}
    assert ("rngs", "dropout", "count") in form.leaf_keys
    assert {"params", "opt_state", "other"} == set(form.leaf_entries)


def test_keywords_statics_and_donation_as_under_nnx_jit(reference):
    """Keyword arguments, static label_smoothing/pad_id (another value compiles once
    more), donated state; restore() by parameter name before the first step."""
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((2, 2)), options=h.no_precompile(),
                              static_argnames=("label_smoothing", "pad_id"),
                              donate_argnames=("model", "optimizer", "metrics"))
    model, optimizer, rngs, metrics = make_program()
    assert step.restore(model, optimizer, rngs=rngs, metrics=metrics) == 0  # nothing saved
    batches = make_batches()
    try:
        for b in batches[:2]:
            step(model, optimizer=optimizer, rngs=rngs, batch=b, metrics=metrics,
                 label_smoothing=0.1, pad_id=PAD)
        assert step.options.compile.donate_state
        for a, b in zip(_host(nnx.state((model, optimizer, rngs))), reference["states"][1],
                        strict=True):  # statics do not change the math
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert step.statistics.compiles == 1
        out = step(model, optimizer, rngs, batches[2], metrics, label_smoothing=0.1, pad_id=1)
        assert np.isfinite(float(out["loss"])) and step.statistics.compiles == 2
    finally:
        step.close()
