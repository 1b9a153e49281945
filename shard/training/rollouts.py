"""One GRPO step as the loop calls it, `(state, prompts) -> (state, metrics)`: sample each prompt's group of
completions with the state's own parameters on the mesh (the KV-cache Generator, no second copy), score
them (shard.training.rewards), compute the group advantages, and take grpo.updates_per_batch optimizer
steps (shard.training.grpo's jitted step). The sampling key is the seed's folded with the step's batch
index and the prompt's place in it, so a resumed run draws the same completions.
"""

import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.config.train import TrainConfig
from shard.data.chat import Prompt
from shard.errors import ShardError
from shard.sharding.rules import Layout
from shard.training import grpo, rewards
from shard.training.dpo import reference_params
from shard.training.generate import Generator, Sampling
from shard.training.state import StateSpec
from shard.training.step import batch_sharding, schedule_inputs


SAMPLES_KEPT = 4  # completions a logged step writes to completions.jsonl


def place_rows(prompts: list[Prompt], completions: np.ndarray, ends: np.ndarray, seq_len: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(rows, trained): (B, seq_len + 1) prompt + completion token ids, -1 past the end, and 1 on the
    completion's tokens; row i holds prompt i // G and completion i, cut after `ends[i]` tokens."""
    group = len(completions) // len(prompts)
    rows = np.full((len(completions), seq_len + 1), -1, np.int32)
    trained = np.zeros_like(rows)
    for i, (completion, end) in enumerate(zip(completions, ends)):
        prompt = prompts[i // group].ids
        rows[i, :len(prompt)] = prompt
        rows[i, len(prompt):len(prompt) + end] = completion[:end]
        trained[i, len(prompt):len(prompt) + end] = 1
    return rows, trained


def completion_ends(completions: np.ndarray, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(each completion's length, its end of text included; whether it was cut at max_new_tokens)."""
    n = completions.shape[1]
    if eos_id is None:
        return np.full(len(completions), n), np.ones(len(completions), bool)
    hit = completions == eos_id
    first = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, n)
    return first, ~hit.any(axis=1)


def per_target(rows_values: np.ndarray, prompts: list[Prompt], group: int, seq_len: int) -> np.ndarray:
    """(B, seq_len) per-target values from (B, max_new_tokens) per-completion-token ones: completion token
    j of row i is the target at position len(prompt) + j - 1."""
    out = np.zeros((len(rows_values), seq_len), np.float32)
    for i, values in enumerate(rows_values):
        start = len(prompts[i // group].ids) - 1
        out[i, start:start + len(values)] = values[:seq_len - start]
    return out


def rollout_layout(cfg: TrainConfig, spec: StateSpec, layout: Layout):
    """(the sampler's layout, its params' shardings): grpo.rollout_mesh over the training mesh's devices,
    or the training layout itself (None: no resharding)."""
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.sharding.rules import param_shardings

    if not cfg.grpo.rollout_mesh:
        return layout, None
    devices = list(layout.mesh.devices.flat)
    try:
        sampler = make_layout(cfg, parse_mesh(cfg.grpo.rollout_mesh), devices)
    except ShardError as e:
        raise ShardError(f"grpo.rollout_mesh: {e}") from None
    if sampler.mesh.size != len(devices):
        raise ShardError(f"grpo.rollout_mesh {cfg.grpo.rollout_mesh} lays out {sampler.mesh.size} devices, the "
                         f"training mesh {len(devices)}: give a mesh of the same devices")
    return sampler, param_shardings(spec.abstract["params"], spec.logical, sampler)  # the same rules, on its mesh


class GrpoStep:
    """The loop's step function for task grpo over a compiled update step (grpo.jit_grpo_step)."""

    def __init__(self, cfg: TrainConfig, spec: StateSpec, layout: Layout, update, prompts, frozen: dict):
        g = cfg.grpo
        self.cfg, self.spec, self.layout, self.update = cfg, spec, layout, update
        self.tokenizer, self.where = prompts.tokenizer, prompts.path
        self.frozen = frozen  # the reference weights (kl_beta > 0)
        self.rewards = list(prompts.rewards)  # loaded by prepare before anything compiled
        self.sampling = Sampling(g.temperature, 0, g.top_p)
        self.rollout_layout, self.rollout_shardings = rollout_layout(cfg, spec, layout)
        self.generator = Generator(spec.model, spec.graphdef, None, self.rollout_layout,
                                   max_len=cfg.data.seq_len + 1, lora=spec.lora)
        self.args = grpo.update_schedule(schedule_inputs(spec, layout), g.updates_per_batch)
        self.logps = grpo.jit_logps(spec, layout, g.temperature) if g.kl_beta else None
        self.key = jax.random.key(cfg.seed)

    def rollout(self, state: dict, index: int, prompts: list[Prompt]) -> tuple[np.ndarray, np.ndarray]:
        """(B, max_new_tokens) completions and their sampler log-probabilities, prompt after prompt."""
        g = self.cfg.grpo
        params, bias = state["params"], state.get("router_bias")
        if self.rollout_shardings is not None:  # resharded in memory onto the sampler's layout
            replicated = NamedSharding(self.rollout_layout.mesh, PartitionSpec())
            params = jax.device_put(params, self.rollout_shardings)
            bias = None if bias is None else jax.device_put(bias, replicated)
        self.generator.params, self.generator.router_bias = params, bias
        key = jax.random.fold_in(self.key, index)
        out = [self.generator.group(p.ids, g.samples_per_prompt, g.max_new_tokens, self.sampling,
                                    jax.random.fold_in(key, k)) for k, p in enumerate(prompts)]
        tokens, logps = jax.device_get(([t for t, _ in out], [lp for _, lp in out]))
        return np.concatenate(tokens), np.concatenate(logps)

    def score(self, prompts: list[Prompt], completions: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, list]:
        """((B, rewards) each reward of each completion's text, cut at its end of text; the texts)."""
        texts = [self.tokenizer.decode(c[:e]) for c, e in zip(completions, ends)]
        rows_of = [(p.line, p.row) for p in prompts for _ in range(self.cfg.grpo.samples_per_prompt)]
        return rewards.score(self.rewards, rows_of, texts, self.where), texts

    def __call__(self, state: dict, batch: tuple[int, list[Prompt]]) -> tuple[dict, dict]:
        g = self.cfg.grpo
        index, prompts = batch
        t0 = time.perf_counter()
        completions, sampler = self.rollout(state, index, prompts)
        rollout_s = time.perf_counter() - t0
        ends, truncated = completion_ends(completions, self.tokenizer.eos_id)
        scores, texts = self.score(prompts, completions, ends)
        total = rewards.total(self.rewards, scores)
        advantages = np.asarray(grpo.group_advantages(total, g.samples_per_prompt, g.normalise_advantages))
        keep = np.asarray(grpo.kept_sequences(total, truncated, g.samples_per_prompt, g))
        mask = np.arange(g.max_new_tokens)[None, :] < ends[:, None]
        batch_arrays, rollout = self._arrays(prompts, completions, ends, sampler, advantages, keep, mask)
        reference_s = 0.0
        if g.kl_beta:
            t0 = time.perf_counter()
            reference = reference_params(state, self.frozen)  # with LoRA: the base, its adapters left out
            rollout["reference"] = jax.block_until_ready(self.logps(reference, batch_arrays, state.get("router_bias")))
            reference_s = time.perf_counter() - t0  # timed apart (a wait the step would otherwise overlap)
        state, metrics = self.update(state, batch_arrays, rollout, self.args)
        metrics = dict(metrics) | {
            "reward": float(total.mean()), "reward_std": float(total.std()),
            "completion_length": float(ends.mean()), "filtered": float(1 - keep.mean()),
            "rollout_s": rollout_s, "reference_s": reference_s,
            "rollout_tokens_per_s": completions.size / max(rollout_s, 1e-9),
            **rewards.per_reward_stats(self.rewards, scores)}
        group = g.samples_per_prompt  # the first prompt's first completions, for completions.jsonl
        metrics["completions"] = [{"line": prompts[i // group].line, "completion": texts[i], "reward": float(total[i])}
                                  for i in range(min(SAMPLES_KEPT, len(texts)))]
        return state, metrics

    def _arrays(self, prompts, completions, ends, sampler, advantages, keep, mask) -> tuple[dict, dict]:
        """The token batch (inputs, targets, mask, loss_mask) and the rollout arrays, placed on the mesh."""
        from shard.data.batches import split_window

        g, seq_len = self.cfg.grpo, self.cfg.data.seq_len
        rows, trained = place_rows(prompts, completions, ends, seq_len)
        tokens = split_window({"tokens": rows, "trained": trained})
        sampler_bt = per_target(np.where(mask, sampler, 0.0), prompts, g.samples_per_prompt, seq_len)
        placed = {k: _place(v, batch_sharding(self.layout)) for k, v in tokens.items()}
        shardings = grpo.rollout_shardings(self.layout, ("mask", "sampler", "advantages", "keep"))
        host = {"mask": tokens["mask"] * tokens["loss_mask"], "sampler": sampler_bt,
                "advantages": advantages.astype(np.float32), "keep": keep.astype(np.float32)}
        return placed, {k: _place(v, shardings[k]) for k, v in host.items()}


def _place(x: np.ndarray, sharding) -> jax.Array:
    """A host array every process holds whole (the rollouts are replicated), as a global array."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def grpo_run_parts(cfg: TrainConfig, spec: StateSpec, layout: Layout, update, prompts, state: dict,
                   start_step: int, position: int, reference=None):
    """(the prompt stream, the step function) of a GRPO run (shard.training.prepare); its reference
    weights as DPO's (shard.training.dpo.frozen_reference), only with a KL penalty."""
    from shard.data.finetune import PromptStream
    from shard.training.dpo import frozen_reference

    frozen = frozen_reference(spec, state, start_step, cfg.seed, reference) if cfg.grpo.kl_beta else {}
    stream = PromptStream(prompts, cfg.data.batch, cfg.grpo.samples_per_prompt, cfg.data.seq_len, cfg.seed, position)
    return stream, GrpoStep(cfg, spec, layout, update, prompts, frozen)
