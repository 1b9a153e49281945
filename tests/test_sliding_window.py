"""Sliding-window attention (model.sliding_window, Mistral): a query at t sees keys t - window + 1 .. t,
transformers' convention, in XLA's attention, the reference, packed rows and the KV cache; cuDNN is
handed the same window; ring attention (context parallel) refuses it in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shard import models
from shard.config.presets import PRESETS
from shard.errors import ShardError
from shard.models import attention, llama
from shard.models.attention import causal_attention
from shard.testing import tiny_config, train_losses

WINDOW = 5


def _qkv(T=16, kv_heads=2):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k1, (2, T, 4, 8)), jax.random.normal(k2, (2, T, kv_heads, 8)),
            jax.random.normal(k3, (2, T, kv_heads, 8)))


def _brute_force(q, k, v, window, seg=None):
    """Softmax attention with transformers' mask: kv_idx > q_idx - window, kv_idx <= q_idx."""
    B, T, N, H = q.shape
    k, v = (np.repeat(np.asarray(x), N // k.shape[2], axis=2) for x in (k, v))
    s = np.einsum("btnh,bsnh->bnts", np.asarray(q), k) * H**-0.5
    t, u = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = np.broadcast_to((u <= t) & (u > t - window), (B, 1, T, T))
    if seg is not None:
        mask = mask & (np.asarray(seg)[:, None, :, None] == np.asarray(seg)[:, None, None, :])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_window_matches_transformers_convention(impl):
    q, k, v = _qkv()
    np.testing.assert_allclose(causal_attention(q, k, v, impl, window=WINDOW), _brute_force(q, k, v, WINDOW),
                               atol=1e-5, rtol=1e-5)
    # a window as long as the sequence is no window; a shorter one changes the late positions only
    np.testing.assert_allclose(causal_attention(q, k, v, impl, window=16), causal_attention(q, k, v, impl),
                               atol=1e-6)
    assert not np.allclose(causal_attention(q, k, v, impl, window=WINDOW)[:, WINDOW:],
                           causal_attention(q, k, v, impl)[:, WINDOW:])


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_window_with_packed_rows(impl):
    q, k, v = _qkv()
    seg = jnp.asarray([[1] * 10 + [2] * 6, [1] * 3 + [2] * 11 + [0] * 2])
    np.testing.assert_allclose(causal_attention(q, k, v, impl, segment_ids=seg, window=WINDOW)[:, :14],
                               _brute_force(q, k, v, WINDOW, seg)[:, :14], atol=1e-5, rtol=1e-5)


def test_cudnn_is_handed_the_window(monkeypatch):
    """cuDNN can't run on CPU: check the call it would get (JAX turns (left, 0) into cuDNN's left + 1)."""
    seen = {}

    def fake(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setattr(attention, "_cudnn_problem", lambda q, segments=False: "")
    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    q, k, v = _qkv()
    causal_attention(q, k, v, "cudnn", window=WINDOW)
    assert seen == {"is_causal": True, "local_window_size": (WINDOW - 1, 0), "implementation": "cudnn", "scale": None}


@pytest.mark.parametrize("prefill", [3, 7])
def test_kv_cache_decoding_equals_the_full_forward(prefill):
    """Prefill a prompt shorter or longer than the window, then decode one at a time past it: each
    step's logits are the full forward's at that position. The cache holds the window alone (4 of the
    12 positions), each new position written over the one that left the window."""
    cfg = dataclasses.replace(PRESETS["tiny"], sliding_window=4, compute_dtype="float32")
    model = models.build(cfg)
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, cfg.vocab_size)
    full = model(tokens)
    cache = llama.init_cache(cfg, 1, 12)
    assert cache["k"].shape == (cfg.n_layers, 1, 4, cfg.n_kv_heads, cfg.head_dim)
    logits, cache = model(tokens[:, :prefill], cache, 0)
    steps = [logits]
    for t in range(prefill, 12):
        logits, cache = model(tokens[:, t:t + 1], cache, t)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)
    assert llama.init_cache(dataclasses.replace(cfg, sliding_window=16), 1, 12)["k"].shape[2] == 12
    params = nnx.to_pure_dict(nnx.state(model))
    unwindowed = llama.forward(dataclasses.replace(cfg, sliding_window=0), params, tokens)[0]
    np.testing.assert_allclose(unwindowed[:, :4], full[:, :4], atol=1e-5)
    assert not np.allclose(unwindowed[:, 4:], full[:, 4:], atol=1e-3)


def test_ring_attention_refuses_a_window():
    with pytest.raises(ShardError, match=r"model.sliding_window=4 can't run with context parallelism .*ring "
                                         "attention has no sliding window") as e:
        train_losses(tiny_config("cp", model__sliding_window=4))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prefill", [3, 11])
def test_gemma_local_layers_cache_the_window_alone(prefill):
    """Gemma's local layers (every other one here) keep a rolling cache of their window, the global ones
    every position; decoding past the window gives the full forward's logits at every position."""
    cfg = dataclasses.replace(PRESETS["gemma3-tiny"], compute_dtype="float32")  # window 8, 4 layers
    model = models.build(cfg)
    tokens = jax.random.randint(jax.random.key(2), (1, 20), 0, cfg.vocab_size)
    full = model(tokens)
    cache = llama.init_cache(cfg, 1, 20)
    assert (cache["k_local"].shape[:3], cache["k"].shape[:3]) == ((2, 1, 8), (2, 1, 20))
    logits, cache = model(tokens[:, :prefill], cache, 0)
    steps = [logits]
    for t in range(prefill, 20):
        logits, cache = model(tokens[:, t:t + 1], cache, t)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=2e-5)
