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

from shard.config.train import GrpoConfig

# The step metrics GRPO adds to the loss (shard.training.loop copies them into records).
GRPO_METRICS = ("kl", "clip_low", "clip_high", "tis_clipped")


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


def grpo_loss(logp_bt: jax.Array, rollout: dict, cfg: GrpoConfig) -> tuple[jax.Array, jax.Array, dict]:
    """(the summed loss, its count, metrics) of the policy's token log-probabilities `logp_bt` on a batch
    of `rollout`s: "mask" (B, T), "advantages" and "keep" (B,), "old" (the trainer's log-probabilities
    when the rollouts were sampled) and "sampler" (the sampler's) (B, T), and "reference" (B, T) when
    kl_beta > 0. The metrics are means over the kept tokens."""
    mask_bt = rollout["mask"] * rollout["keep"][:, None]
    loss_bt, low_bt, high_bt = surrogate_terms(logp_bt, rollout["old"], rollout["advantages"], cfg)
    weight_bt = jax.lax.stop_gradient(tis_weights(rollout["old"], rollout["sampler"], cfg.tis_cap))
    loss_bt = loss_bt * weight_bt
    tokens = jnp.maximum(jnp.sum(mask_bt), 1.0)
    mean = lambda x_bt: jnp.sum(x_bt * mask_bt) / tokens  # noqa: E731
    metrics = {"clip_low": mean(low_bt), "clip_high": mean(high_bt),
               "tis_clipped": mean(weight_bt >= cfg.tis_cap) if cfg.tis_cap else jnp.zeros(())}
    if cfg.kl_beta:
        kl_bt = k3_kl(logp_bt, rollout["reference"])
        loss_bt = loss_bt + cfg.kl_beta * kl_bt
        metrics["kl"] = mean(kl_bt)
    else:
        metrics["kl"] = jnp.zeros(())
    total, count = normalised_sum(loss_bt, mask_bt, cfg.loss_norm, cfg.max_new_tokens)
    return total, count, metrics
