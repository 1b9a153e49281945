"""GRPO (task grpo): the loss terms equal a NumPy computation on a fixed batch of rollouts."""

import dataclasses

import numpy as np
import pytest

from shard.config.train import GrpoConfig
from shard.training import grpo

P, G, T = 3, 4, 5  # prompts, completions per prompt, target positions


def _batch():
    rng = np.random.default_rng(0)
    rewards = np.array([1, 0, 0, 1, 2, 2, 2, 2, 0.5, 0, 1, 0], np.float32)  # the middle group: no signal
    mask = np.ones((P * G, T), np.float32)
    mask[:, :2] = 0  # the prompt's targets
    mask[3, 4:] = 0  # a short completion; its padding
    logp = rng.normal(-1.5, 0.5, (P * G, T)).astype(np.float32)
    old = logp + rng.normal(0, 0.3, logp.shape).astype(np.float32)
    sampler = old + rng.normal(0, 0.5, logp.shape).astype(np.float32)
    reference = logp + rng.normal(0, 0.2, logp.shape).astype(np.float32)
    truncated = np.array([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0], bool)
    return rewards, truncated, dict(mask=mask, old=old, sampler=sampler, reference=reference), logp


def _np_advantages(rewards, normalise):
    r = rewards.reshape(P, G)
    adv = r - r.mean(1, keepdims=True)
    if normalise:
        adv = adv / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    return adv.reshape(-1)


@pytest.mark.parametrize("normalise", [True, False])
def test_advantages_are_each_reward_less_its_group_mean_over_its_std(normalise):
    rewards = _batch()[0]
    got = np.asarray(grpo.group_advantages(rewards, G, normalise))
    np.testing.assert_allclose(got, _np_advantages(rewards, normalise), rtol=1e-5, atol=1e-6)
    assert not got[4:8].any()  # an all-equal group has no advantage, scaled or not


def test_filters_leave_out_groups_without_signal_and_truncated_completions():
    rewards, truncated, _, _ = _batch()
    cfg = GrpoConfig(filter_zero_advantage=True, filter_truncated=True)
    keep = np.asarray(grpo.kept_sequences(rewards, truncated, G, cfg))
    np.testing.assert_array_equal(keep, [1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1])
    off = GrpoConfig(filter_zero_advantage=False, filter_truncated=False)
    assert np.asarray(grpo.kept_sequences(rewards, truncated, G, off)).all()


def _np_loss(logp, rollout, adv, keep, cfg):
    """The loss written out in NumPy from docs/formulas.md#grpo."""
    mask = rollout["mask"] * keep[:, None]
    ratio = np.exp(logp - rollout["old"])
    a = adv[:, None]
    surrogate = -np.minimum(ratio * a, np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * a)
    weight = np.minimum(np.exp(rollout["old"] - rollout["sampler"]), cfg.tis_cap) if cfg.tis_cap else 1.0
    r = rollout["reference"] - logp
    kl = np.exp(r) - r - 1
    per_token = surrogate * weight + cfg.kl_beta * kl
    sums, tokens = (per_token * mask).sum(1), mask.sum(1)
    if cfg.loss_norm == "token":
        loss = sums.sum() / tokens.sum()
    elif cfg.loss_norm == "sequence":
        loss = (sums[tokens > 0] / tokens[tokens > 0]).mean()
    else:
        loss = sums.sum() / ((tokens > 0).sum() * cfg.max_new_tokens)
    low = ((ratio < 1 - cfg.clip_low) & (a < 0) & (mask > 0)).sum() / mask.sum()
    high = ((ratio > 1 + cfg.clip_high) & (a > 0) & (mask > 0)).sum() / mask.sum()
    return loss, (kl * mask).sum() / mask.sum(), low, high


@pytest.mark.parametrize("settings", [
    dict(loss_norm="token", clip_high=0.28, kl_beta=0.04, tis_cap=2.0),  # DAPO's clip-higher, with KL
    dict(loss_norm="sequence", kl_beta=0.0, tis_cap=0.0),  # the original GRPO's normaliser, no KL, no TIS
    dict(loss_norm="constant", max_new_tokens=T, normalise_advantages=False, filter_zero_advantage=False),
])
def test_the_clipped_surrogate_kl_and_normalisers_equal_numpy(settings):
    cfg = dataclasses.replace(GrpoConfig(), **settings)
    rewards, truncated, rollout, logp = _batch()
    adv = _np_advantages(rewards, cfg.normalise_advantages)
    keep = np.asarray(grpo.kept_sequences(rewards, truncated, G, cfg))
    total, count, metrics = grpo.grpo_loss(logp, rollout | {"advantages": adv, "keep": keep}, cfg)
    loss, kl, low, high = _np_loss(logp, rollout, adv, keep, cfg)
    np.testing.assert_allclose(float(total / count), loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kl"]), kl if cfg.kl_beta else 0.0, rtol=1e-5)
    assert (float(metrics["clip_low"]), float(metrics["clip_high"])) == pytest.approx((low, high))
    assert low > 0 and high > 0  # the batch reaches both clip bounds: the test reads both


def test_the_gradient_of_a_token_outside_the_clip_is_zero():
    """PPO's point: once the ratio passes 1 + clip_high with A > 0 the token pushes no further."""
    import jax

    cfg = GrpoConfig(clip_high=0.2, tis_cap=0.0)
    rollout = {"mask": np.ones((2, 1), np.float32), "old": np.zeros((2, 1), np.float32),
               "sampler": np.zeros((2, 1), np.float32), "advantages": np.array([1.0, 1.0], np.float32),
               "keep": np.ones(2, np.float32)}
    logp = np.array([[0.1], [0.5]], np.float32)  # ratios 1.105 (inside) and 1.65 (clipped)
    grads = jax.grad(lambda lp: grpo.grpo_loss(lp, rollout, cfg)[0])(logp)
    np.testing.assert_allclose(np.asarray(grads), [[-np.exp(0.1)], [0.0]], rtol=1e-6)
