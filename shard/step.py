"""One jitted SPMD train step: next-token loss, gradients (optionally accumulated over microbatches),
the optax update. State is donated; input and output shardings are explicit."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import BATCH, LENGTH
from shard.config import GuardConfig
from shard.rules import Layout, activation_layout
from shard.state import StateSpec

BATCH_KEYS = ("inputs", "targets", "mask")


def batch_sharding(layout: Layout) -> NamedSharding:
    return layout.sharding((BATCH, LENGTH), what="batch")


def token_nll(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array):
    """Summed next-token cross-entropy over unmasked positions, and their count (float32).

    The target logit is picked with a one-hot product so that a vocab-sharded logits tensor reduces
    locally instead of being gathered.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_bt = jnp.sum(logits_btv * jax.nn.one_hot(targets_bt, logits_btv.shape[-1], dtype=jnp.float32), -1)
    return jnp.sum((logz_bt - target_bt) * mask_bt), jnp.sum(mask_bt)


def _microbatches(x: jax.Array, m: int, layout: Layout) -> jax.Array:
    """(B, ...) -> (m, B/m, ...) taking every m-th row, so each device's rows split evenly across
    microbatches and no rows move between devices."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    spec = batch_sharding(layout).spec
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, PartitionSpec(None, *spec)))


def make_step_parts(spec: StateSpec, layout: Layout, microbatches: int = 1, guard: GuardConfig | None = None):
    """The two halves of a step, to be traced inside a jit: `grad_sums(params, batch)` gives gradients,
    summed next-token loss and token count over the batch this program sees (not yet normalised), and
    `apply(state, grads, nll, count)` normalises by the count, updates and reports metrics. The MPI
    bridge sums the first half's outputs across processes before the second.

    With `guard.action == "skip"`, a step whose loss or gradient norm is not finite (or above
    guard.max_grad_norm) keeps the old params and optimizer state, and reports `skipped = 1`.
    """
    graphdef, tx, schedule = spec.graphdef, spec.tx, spec.schedule
    skip_bad = guard is not None and guard.action == "skip"

    def loss_fn(params, mb):
        logits = nnx.merge(graphdef, params)(mb["inputs"])
        return token_nll(logits, mb["targets"], mb["mask"])

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_sums(params, batch):
        with activation_layout(layout):
            if microbatches == 1:
                (nll, count), grads = grad_fn(params, batch)
            else:
                mbs = {k: _microbatches(batch[k], microbatches, layout) for k in BATCH_KEYS}

                def accumulate(carry, mb):
                    g_acc, nll_acc, n_acc = carry
                    (nll, n), g = grad_fn(params, mb)
                    return (jax.tree.map(jnp.add, g_acc, g), nll_acc + nll, n_acc + n), None

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                zeros = jax.lax.with_sharding_constraint(zeros, spec.shardings["params"])
                carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
                (grads, nll, count), _ = jax.lax.scan(accumulate, carry, mbs)
        return grads, nll, count

    def apply(state, grads, nll, count):
        params = state["params"]
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
        loss, grad_norm = nll / count, optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]), "tokens": count}
        if skip_bad:
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (grad_norm <= guard.max_grad_norm)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
            metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
        return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    return grad_sums, apply


def make_train_step(spec: StateSpec, layout: Layout, microbatches: int = 1, guard: GuardConfig | None = None):
    """The jitted step `(state, batch) -> (state, metrics)`; `state` is donated."""
    grad_sums, apply = make_step_parts(spec, layout, microbatches, guard)

    def step(state, batch):
        return apply(state, *grad_sums(state["params"], batch))

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    data = batch_sharding(layout)
    return jax.jit(
        step,
        in_shardings=(spec.shardings, {k: data for k in BATCH_KEYS}),
        out_shardings=(spec.shardings, replicated),
        donate_argnums=0,
    )


def make_eval_step(spec: StateSpec, layout: Layout):
    """The jitted `(params, batch) -> (summed next-token loss, token count)`, forward only."""
    graphdef = spec.graphdef

    def evaluate(params, batch):
        with activation_layout(layout):
            logits = nnx.merge(graphdef, params)(batch["inputs"])
            return token_nll(logits, batch["targets"], batch["mask"])

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    data = batch_sharding(layout)
    return jax.jit(evaluate, in_shardings=(spec.shardings["params"], {k: data for k in BATCH_KEYS}),
                   out_shardings=replicated)


def abstract_batch(layout: Layout, batch: int, seq_len: int) -> dict:
    data = batch_sharding(layout)
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32}
    return {k: jax.ShapeDtypeStruct((batch, seq_len), dtypes[k], sharding=data) for k in BATCH_KEYS}
