"""shard's train loop against a minimal hand-written jax+optax loop: same model, batch and shardings.

Runs both in one process, alternating, and prints the median time per step of each and their ratio
(goal: <= 1.03). The last line is `ratio: X`.

    python benchmarks/overhead.py [--mesh fsdp] [--model small] [--steps 20] [--repeats 5]
    python benchmarks/overhead.py --data STORE --packing packed   # the loader of a packed token store

With --data, shard's loop reads that data (a prepared store: `shard data prepare`); the baseline is
then shard's own compiled step fed one batch made beforehand, over and over, so the ratio is what the
loader and the loop add to the step (with packed rows the step attends within documents, which the
textbook loop does not).
"""

import argparse
import dataclasses
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shard import config, prepare, train, activation_layout, batch_sharding


def hand_written(run, cfg):
    """The textbook loop: jit(step, donate) over params/opt_state placed with the same shardings."""
    graphdef = run.spec.graphdef
    tx = run.spec.tx  # the same optimizer math, so only the loop and step plumbing differ
    params = jax.tree.map(jnp.copy, run.state["params"])
    opt_state = jax.jit(tx.init, out_shardings=run.spec.shardings["opt_state"])(params)

    def loss_fn(p, x, y):
        # The model's own activation constraints stay on, so both loops run the same SPMD program
        # and the ratio measures shard's plumbing (data, metrics, observers), not XLA's layout choice.
        with activation_layout(run.layout):
            logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(p, o, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    sharding = batch_sharding(run.layout)
    rng = np.random.default_rng(0)
    shape = (cfg.data.batch, cfg.data.seq_len)
    state = [params, opt_state]

    def run_steps(n):
        p, o = state
        for _ in range(n):
            tokens = rng.integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1), dtype=np.int32)
            x = jax.device_put(tokens[:, :-1], sharding)
            y = jax.device_put(tokens[:, 1:], sharding)
            p, o, loss = step(p, o, x, y)
        loss.block_until_ready()
        state[:] = [p, o]

    run_steps(1)  # compile
    return run_steps


def same_step_fixed_batch(run):
    """shard's compiled step on one batch made beforehand: the step without the loader or the loop."""
    batch = run.stream.next()
    state = [jax.tree.map(jnp.copy, run.state)]

    def run_steps(n):
        s = state[0]
        for _ in range(n):
            s, metrics = run.step_fn(s, batch)
        jax.block_until_ready(metrics)
        state[0] = s

    run_steps(1)
    return run_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="fsdp")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--data", default="synthetic", help="what shard's loop reads (default: synthetic tokens)")
    ap.add_argument("--packing", default="concat")
    args = ap.parse_args()
    sets = [f"mesh.spec={args.mesh}", f"model.name={args.model}", f"steps={args.steps}",
            f"log_every={args.steps}", f"data.batch={args.batch}", f"data.seq_len={args.seq}",
            f"data.path={args.data}", f"data.packing={args.packing}"]
    if args.data != "synthetic":
        from shard.data.corpus import fit_vocab

        cfg, _ = fit_vocab(config.resolve(config.parse_sets(sets)), vocab_set=False)
    else:
        cfg = config.resolve(config.parse_sets(sets))
    run = prepare(cfg)
    train(cfg, run=run)  # warm up
    baseline = hand_written(run, cfg) if args.data == "synthetic" else same_step_fixed_batch(run)
    shard_times, base_times = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        train(dataclasses.replace(cfg, steps=run.trained_to + args.steps), run=run)  # the next args.steps steps
        shard_times.append((time.perf_counter() - t) / args.steps)
        t = time.perf_counter()
        baseline(args.steps)
        base_times.append((time.perf_counter() - t) / args.steps)
    s, b = statistics.median(shard_times), statistics.median(base_times)
    print(f"model {args.model}, mesh {args.mesh} ({jax.device_count()} devices), batch {args.batch}x{args.seq}, "
          f"data {args.data} ({args.packing})")
    print(f"shard step:        {s * 1e3:8.2f} ms (median of {args.repeats} x {args.steps} steps)")
    print(f"{'hand-written' if args.data == 'synthetic' else 'fixed-batch'} step: {b * 1e3:8.2f} ms")
    print(f"ratio: {s / b:.3f}")


if __name__ == "__main__":
    main()
