"""Group relative policy optimisation (task = "grpo"; Shao et al. 2024) and its variants as pure functions
of a batch of rollouts: DAPO's clip-higher, token-level normalisation and filters (Yu et al. 2025),
Dr. GRPO's unscaled advantages and constant normaliser (Liu et al. 2025), truncated importance sampling
for the sampler/trainer gap (Yao et al. 2025). docs/formulas.md#grpo has each formula.

A batch holds P prompts x G completions: row p * G + g is completion g of prompt p.
Per-token arrays are (B, T) over a row's targets, `mask_bt` 1 on the completion's tokens (the trained
ones); per-sequence arrays are (B,).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import BATCH
from shard.config.finetune import GrpoConfig
from shard.config.train import GuardConfig
from shard.errors import ShardError
from shard.models import llama
from shard.models.lora import adapting
from shard.sharding.rules import Layout, activation_layout
from shard.training import lora
from shard.training.state import StateSpec
from shard.training.step import batch_sharding, context_order, make_step_parts, pipeline_stages

# The step metrics GRPO adds to the loss (shard.training.loop copies them into records).
GRPO_METRICS = ("kl", "clip_low", "clip_high", "tis_clipped", "logp_gap", "entropy", "reward", "reward_std",
                "completion_length", "filtered", "rollout_s", "reference_s", "rollout_tokens_per_s")


def group_advantages(rewards_b: jax.Array, group: int, normalise: bool = True, eps: float = 1e-4) -> jax.Array:
    """(B,) each completion's reward less its group's mean; `normalise`: divided by the group's standard
    deviation (unbiased, as TRL and verl compute it) + eps; without it, Dr. GRPO's unscaled advantage."""
    rewards_pg = rewards_b.reshape(-1, group).astype(jnp.float32)
    adv_pg = rewards_pg - jnp.mean(rewards_pg, axis=1, keepdims=True)
    if normalise:
        adv_pg = adv_pg / (jnp.std(rewards_pg, axis=1, keepdims=True, ddof=1) + eps)
    return adv_pg.reshape(-1)


def kept_sequences(rewards_b: jax.Array, truncated_b: jax.Array, group: int, cfg: GrpoConfig) -> jax.Array:
    """(B,) 1.0 for a completion the loss reads, 0.0 for one filtered out: every completion of a group
    whose rewards are all equal (its advantages are 0: no signal, only a smaller normaliser) with
    `filter_zero_advantage`, and one cut at max_new_tokens (`truncated_b`) with `filter_truncated`."""
    rewards_pg = rewards_b.reshape(-1, group)
    keep_b = jnp.ones(rewards_b.shape, jnp.float32)
    if cfg.filter_zero_advantage:
        varied_p = jnp.any(rewards_pg != rewards_pg[:, :1], axis=1)
        keep_b = keep_b * jnp.repeat(varied_p, group).astype(jnp.float32)
    if cfg.filter_truncated:
        keep_b = keep_b * (1.0 - truncated_b.astype(jnp.float32))
    return keep_b


def k3_kl(logp_bt: jax.Array, ref_bt: jax.Array) -> jax.Array:
    """(B, T) Schulman's k3 estimator of KL(policy || reference) per token: exp(r) - r - 1 with
    r = ref - logp; unbiased, never negative."""
    r_bt = ref_bt - logp_bt
    return jnp.exp(r_bt) - r_bt - 1.0


def tis_weights(old_bt: jax.Array, sampler_bt: jax.Array, cap: float) -> jax.Array:
    """(B, T) truncated importance weights min(pi_old / pi_sampler, cap): the trainer's probability of each
    sampled token over the sampler's (they differ by the sampler's numerics: a KV cache, another layout);
    cap 0: no correction (all 1)."""
    if not cap:
        return jnp.ones_like(old_bt)
    return jnp.minimum(jnp.exp(old_bt - sampler_bt), cap)


def surrogate_terms(logp_bt: jax.Array, old_bt: jax.Array, adv_b: jax.Array, cfg: GrpoConfig
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(B, T) PPO's clipped surrogate to minimise, -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A),
    with ratio = exp(logp - old); and where the clip bound the ratio below (A < 0) and above (A > 0)."""
    ratio_bt = jnp.exp(logp_bt - old_bt)
    adv_bt = adv_b[:, None]
    clipped_bt = jnp.clip(ratio_bt, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss_bt = -jnp.minimum(ratio_bt * adv_bt, clipped_bt * adv_bt)
    low_bt = (ratio_bt < 1.0 - cfg.clip_low) & (adv_bt < 0)
    high_bt = (ratio_bt > 1.0 + cfg.clip_high) & (adv_bt > 0)
    return loss_bt, low_bt, high_bt


def normalised_sum(loss_bt: jax.Array, mask_bt: jax.Array, norm: str, max_new_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(the summed loss, its count): the step divides one by the other (shard.training.step's apply), so
    the loss is a mean over the kept tokens (token: DAPO), over the kept sequences of each one's mean
    token (sequence: GRPO), or the token sum over kept sequences x max_new_tokens (constant: Dr. GRPO)."""
    tokens_b = jnp.sum(mask_bt, axis=1)
    sums_b = jnp.sum(loss_bt * mask_bt, axis=1)
    sequences = jnp.sum(tokens_b > 0).astype(jnp.float32)
    if norm == "token":
        return jnp.sum(sums_b), jnp.sum(tokens_b)
    if norm == "sequence":
        return jnp.sum(sums_b / jnp.maximum(tokens_b, 1.0)), sequences
    return jnp.sum(sums_b), sequences * max_new_tokens


def token_entropy(logp_btv: jax.Array) -> jax.Array:
    """(B, T) the entropy -sum_v p log p of each position's distribution, from its log-probabilities
    (B, T, V); a probability of 0 adds 0. No gradient flows through it: a metric, not a loss term."""
    logp_btv = jax.lax.stop_gradient(logp_btv)
    p_btv = jnp.exp(logp_btv)
    return -jnp.sum(jnp.where(p_btv > 0, p_btv * logp_btv, 0.0), axis=-1)


def grpo_loss(logp_bt: jax.Array, rollout: dict, cfg: GrpoConfig, entropy_bt: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, dict]:
    """(the summed loss, its count, metrics) of the policy's token log-probabilities `logp_bt` on a batch
    of `rollout`s: "mask" (B, T), "advantages" and "keep" (B,), "old" (the trainer's log-probabilities
    when the rollouts were sampled) and "sampler" (the sampler's) (B, T), and "reference" (B, T) when
    kl_beta > 0. The metrics are means over the kept tokens, the policy's entropy among them where
    `entropy_bt` (`token_entropy`) is given."""
    mask_bt = rollout["mask"] * rollout["keep"][:, None]
    loss_bt, low_bt, high_bt = surrogate_terms(logp_bt, rollout["old"], rollout["advantages"], cfg)
    weight_bt = jax.lax.stop_gradient(tis_weights(rollout["old"], rollout["sampler"], cfg.tis_cap))
    loss_bt = loss_bt * weight_bt
    tokens = jnp.maximum(jnp.sum(mask_bt), 1.0)
    mean = lambda x_bt: jnp.sum(x_bt * mask_bt) / tokens  # noqa: E731
    metrics = {"clip_low": mean(low_bt), "clip_high": mean(high_bt),
               "logp_gap": mean(jnp.abs(rollout["old"] - rollout["sampler"])),  # the sampler/trainer mismatch
               "tis_clipped": mean(weight_bt >= cfg.tis_cap) if cfg.tis_cap else jnp.zeros(())}
    if entropy_bt is not None:
        metrics["entropy"] = mean(entropy_bt)
    if cfg.kl_beta:
        kl_bt = k3_kl(logp_bt, rollout["reference"])
        loss_bt = loss_bt + cfg.kl_beta * kl_bt
        metrics["kl"] = mean(kl_bt)
    else:
        metrics["kl"] = jnp.zeros(())
    total, count = normalised_sum(loss_bt, mask_bt, cfg.loss_norm, cfg.max_new_tokens)
    return total, count, metrics


# What a rollout batch holds beside the token batch: per-token (B, T) and per-sequence (B,) arrays.
ROLLOUT_SEQUENCE_KEYS = ("advantages", "keep")


def token_logps(cfg, layout: Layout, params: dict, batch: dict, temperature: float, router_bias=None
                ) -> tuple[jax.Array, jax.Array, dict]:
    """(B, T) the log-probability of each target under softmax(logits / temperature), as the sampler
    drew it; (B, T) the entropy of that distribution (`token_entropy`, from the same logits: a caller
    that does not read it leaves it to XLA to drop); and the forward's MoE statistics."""
    batch, zigzag = context_order(batch, layout, cfg)
    if zigzag:  # per-token values must stay in the rows' order
        raise ShardError("task grpo does not run with context parallelism (a context axis) yet; use another mesh")
    logits_btv, moe = llama.forward(cfg, params, batch["inputs"], False, router_bias=router_bias)
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, batch["targets"][..., None], axis=-1)[..., 0]
    return logp_bt, token_entropy(logp_btv), moe


def rollout_shardings(layout: Layout, keys) -> dict:
    """The shardings of a rollout dict's arrays: rows over the batch axes, positions as the batch's."""
    per_sequence = layout.sharding((BATCH,), what="rollout")
    return {k: per_sequence if k in ROLLOUT_SEQUENCE_KEYS else batch_sharding(layout) for k in keys}


def rollout_keys(cfg: GrpoConfig) -> tuple[str, ...]:
    """The rollout arrays a step reads (the reference's log-probabilities only with a KL penalty)."""
    return ("mask", "sampler", "advantages", "keep") + (("reference",) if cfg.kl_beta else ())


def update_schedule(args: dict, updates: int) -> dict:
    """The schedule inputs (shard.training.step.schedule_inputs) of a run that takes `updates` optimizer
    updates a step: its warm-up and decay counted in updates, so the schedule spans the run's steps."""
    return {k: v * updates if k in ("warmup", "decay") else v for k, v in args.items()}


def rollout_shapes(layout: Layout, cfg) -> dict:
    """The rollout arrays of a TrainConfig's step as abstract shapes (for the compile ahead of time)."""
    shardings = rollout_shardings(layout, rollout_keys(cfg.grpo))
    shape = lambda k: (cfg.data.batch,) if k in ROLLOUT_SEQUENCE_KEYS else (cfg.data.batch, cfg.data.seq_len)  # noqa: E731
    return {k: jax.ShapeDtypeStruct(shape(k), jnp.float32, sharding=s) for k, s in shardings.items()}


def jit_logps(spec: StateSpec, layout: Layout, temperature: float):
    """The jitted `(params, batch, router_bias) -> (B, T)` log-probabilities, without gradients: the
    reference's."""
    cfg = spec.model

    def logps(params, batch, router_bias):
        with activation_layout(layout), adapting(spec.lora, None):
            return token_logps(cfg, layout, params, batch, temperature, router_bias)[0]

    return jax.jit(logps, out_shardings=batch_sharding(layout))


def jit_grpo_step(spec: StateSpec, layout: Layout, cfg: GrpoConfig, guard: GuardConfig | None = None):
    """The jitted `(state, batch, rollout, args) -> (state, metrics)`: grpo.updates_per_batch optimizer
    updates on the clipped surrogate (`grpo_loss`) of a batch of rollouts, the ratio's denominator the
    policy before the first; one train step (state["step"] + 1, the metrics the last update's). The
    schedule in `args` counts updates (`update_schedule`). `state` is donated."""
    if pipeline_stages(layout) > 1:
        raise ShardError("task grpo does not run through a pipeline (a mesh with a stage axis) yet; use another mesh")
    _, apply = make_step_parts(spec, layout, 1, guard)

    def loss_fn(params, batch, rollout, router_bias):
        logp_bt, entropy_bt, moe = token_logps(spec.model, layout, params, batch, cfg.temperature, router_bias)
        if "old" not in rollout:  # one update per batch: the ratio is 1, its gradient the policy gradient's
            rollout = rollout | {"old": jax.lax.stop_gradient(logp_bt)}
        total, count, metrics = grpo_loss(logp_bt, rollout, cfg, entropy_bt)
        return total, (count, metrics, moe)

    grad_fn = lora.grad_of_trained(spec, loss_fn)

    def step(state, batch, rollout, args):
        first = state["step"]
        with activation_layout(layout), adapting(spec.lora, lora.dropout_key(first)):
            if cfg.updates_per_batch > 1:  # the policy the rollouts came from, held for every update
                rollout = rollout | {"old": jax.lax.stop_gradient(token_logps(
                    spec.model, layout, state["params"], batch, cfg.temperature, state.get("router_bias"))[0])}
            for _ in range(cfg.updates_per_batch):
                (total, (count, metrics, moe)), grads = grad_fn(state["params"], batch, rollout,
                                                                state.get("router_bias"))
                state, out = apply(state, grads, total, count, moe, args)
        return state | {"step": first + 1}, out | metrics

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(spec.shardings, batch_sharding(layout),
                                       rollout_shardings(layout, rollout_keys(cfg)), replicated),
                   out_shardings=(spec.shardings, replicated), donate_argnums=0)
