"""GRPO on 8 simulated devices: where a step's time goes (sampling the rollouts, the KL reference's pass,
the training updates) and the rollout's tokens/s, with shard's KV-cache generator against uncached
sampling (each new token a forward pass over the whole sequence so far, as a sampler without a cache
runs).

Times are medians over the timed steps after a warm-up one, on simulated CPU devices that share the
host's cores: they show the split of a step's work and the cache's gain on CPU, not GPU throughput.
The training time is the step's wall time less the rollout and the reference (the update is the rest).
The last line counts the compiles that happened inside the timing (the sampler's prefill compiles once a
prompt length, so a length first drawn after the warm-up step compiles in a timed one).

    python benchmarks/rl.py [--model tiny] [--mesh 2x4] [--steps 4] [--batch 16] [--group 8] [--seq 64] [--new 16]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shard import Observer, config, prepare, train


class Compiles(Observer):
    """Counts the jit compiles (lowerings; persistent-cache hits too) while `counting`: from the first logged
    step on, as an observer of the run, so a compile inside a timed step or loop shows in the figures."""

    def __init__(self):
        import jax

        self.counting, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, seconds: float, **kwargs) -> None:
        self.count += self.counting and event == "/jax/core/compile/jaxpr_to_mlir_module_duration"

    def on_log(self, record: dict) -> None:
        self.counting = True

    def take(self) -> int:
        """The count so far, and counting again from 0."""
        count, self.count = self.count, 0
        return count

    def close(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._heard)


def grpo_config(args, folder: Path):
    """A GRPO run on the toy task of tests/test_grpo.py (lower-case letters rewarded), KL on."""
    (folder / "toy.py").write_text("def lower(row, text):\n    return sum('a' <= c <= 'z' for c in text) / len(text)\n")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"word {i}:"}) + "\n" for i in range(16)))
    sets = [f"model.name={args.model}", f"mesh.spec={args.mesh}", f"steps={args.steps + 1}", "task=grpo",
            f"data.path={folder / 'prompts.jsonl'}", f"data.batch={args.batch}", f"data.seq_len={args.seq}",
            f"grpo.rewards={folder / 'toy.py'}:lower", f"grpo.samples_per_prompt={args.group}",
            f"grpo.max_new_tokens={args.new}", "grpo.kl_beta=0.04", "log_every=1", "checkpoint.every=0"]
    return config.resolve(config.layer(None, {}, {}, sets))


def uncached_tokens_per_s(run, args, prompt: list[int], compiles: Compiles) -> float:
    """Tokens/s of sampling a group with no cache: every new token a forward pass over the whole sequence."""
    import jax
    import jax.numpy as jnp

    from shard.models import llama
    from shard.sharding.rules import activation_layout

    cfg, layout = run.spec.model, run.layout

    @jax.jit
    def next_token(params, tokens_bt, at, key):  # the token at position `at` of every row, drawn
        with activation_layout(layout):
            logits_btv, _ = llama.forward(cfg, params, tokens_bt)
        logits_bv = jax.lax.dynamic_index_in_dim(logits_btv, at - 1, axis=1, keepdims=False)
        token_b = jax.random.categorical(key, logits_bv).astype(jnp.int32)
        return jax.lax.dynamic_update_slice(tokens_bt, token_b[:, None], (0, at))

    tokens = jnp.zeros((args.group, args.seq), jnp.int32).at[:, :len(prompt)].set(jnp.asarray(prompt))
    key, params = jax.random.key(0), run.state["params"]
    warm = jax.block_until_ready(next_token(params, tokens, len(prompt), key))
    # compiled again for the rows placed as its output places them, as the loop feeds them back (the first
    # compile took them unplaced): no compile inside the timed loop
    tokens = jax.device_put(tokens, warm.sharding)
    jax.block_until_ready(next_token(params, tokens, len(prompt), key))
    compiles.take()
    t0 = time.perf_counter()
    for i in range(args.new):
        tokens = next_token(params, tokens, len(prompt) + i, jax.random.fold_in(key, i))
    jax.block_until_ready(tokens)
    return args.group * args.new / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--new", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = grpo_config(args, Path(tmp))
        run = prepare(cfg)
        compiles = Compiles()
        try:  # the first step compiles the sampler and the reference pass: left out
            records = train(cfg, run=run, observers=[compiles])[1:]
            in_steps = compiles.take()
            prompt = list(run.stream.dataset.prompts[0].ids)
            uncached = uncached_tokens_per_s(run, args, prompt, compiles)
            in_loop = compiles.take()
        finally:
            compiles.close()
    med = {k: statistics.median(r[k] for r in records) for k in ("step_time_s", "rollout_s", "reference_s",
                                                                  "rollout_tokens_per_s")}
    train_s = med["step_time_s"] - med["rollout_s"] - med["reference_s"]
    print(f"GRPO {args.model} on {args.mesh}: {args.batch} completions a step ({args.group} a prompt), "
          f"{args.new} new tokens, seq {args.seq}; medians of {len(records)} steps")
    for name, s in (("rollout", med["rollout_s"]), ("reference", med["reference_s"]), ("training", train_s)):
        print(f"  {name:10s} {s * 1e3:8.1f} ms  {s / med['step_time_s']:6.1%}")
    print(f"  rollout tokens/s: KV cache {med['rollout_tokens_per_s']:,.0f}, uncached {uncached:,.0f} "
          f"({med['rollout_tokens_per_s'] / uncached:.1f}x)")
    # the sampler's prefill compiles once a prompt length: a length first drawn after step 1 compiles there
    print(f"  compiles while timed: {in_steps} in the steps, {in_loop} in the uncached loop")


if __name__ == "__main__":
    main()
