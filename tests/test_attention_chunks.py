"""Attention in chunks of queries (model.attention_chunk, shard.models.attention.query_chunked) against all
queries at once: the same outputs and gradients for every mask the model uses, on one device and on
sharded layouts, and the automatic chunk size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard.models.attention import causal_attention
from shard.sharding.decisions import ATTENTION_CHUNK_MIN_QUERIES, ATTENTION_CHUNK_SCORES_BYTES, attention_chunks
from shard.testing import loss_and_grads, tiny_config

B, T, N, K, H = 2, 32, 4, 2, 8
SEG = np.repeat([[1] * 10 + [2] * 19 + [0] * 3], B, 0).astype(np.int32)
MASKS = {  # causal_attention's keywords; soft-capped scores and a traced window run the einsum version
    "causal": {},
    "packed": {"segment_ids": SEG},
    "window": {"window": 5},
    "packed-window-scale": {"segment_ids": SEG, "window": 7, "scale": 0.3},
    "softcap-traced-window": {"softcap": 2.0, "window": 6, "traced": True},
    "softcap-packed": {"softcap": 2.0, "segment_ids": SEG},
}


@pytest.mark.parametrize("name", MASKS)
def test_chunked_attention_matches_all_queries_at_once(name):
    kw = dict(MASKS[name])
    if kw.pop("traced", False):
        kw["window"] = jnp.asarray(kw["window"])
    r = np.random.default_rng(0)
    qkv = [jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]

    def objective(q, k, v, chunk):
        return jnp.sum(jnp.sin(causal_attention(q, k, v, "xla", chunk=chunk, **kw)))

    whole = jax.value_and_grad(objective, argnums=(0, 1, 2))(*qkv, 0)
    chunked = jax.value_and_grad(objective, argnums=(0, 1, 2))(*qkv, 8)  # 4 chunks
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert not np.allclose(whole[1][0], 0)


@pytest.mark.parametrize("mesh,model", [("2x4", "mistral-tiny"), ("fsdp", "gemma2-tiny")])
def test_chunked_attention_loss_and_gradients_match_on_layouts(mesh, model):
    """Packed rows: mistral's window through XLA's attention with heads split over `model`, gemma2's
    soft-capped scores and per-layer windows through the einsum version under FSDP."""
    whole = loss_and_grads(tiny_config(mesh, model__name=model, model__attention_chunk=0), packed=True)
    chunked = loss_and_grads(tiny_config(mesh, model__name=model, model__attention_chunk=8), packed=True)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
    for (path, a), b in zip(jax.tree.leaves_with_path(whole[1]), jax.tree.leaves(chunked[1])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max(), err_msg=jax.tree_util.keystr(path))


def test_attention_chunks_rule():
    # llama-1b on one device, batch 4 x 2048: 1 MiB of scores per query, 256 queries per chunk
    assert attention_chunks(-1, 2048, rows=4, heads=32) == 2048 * 2**20 // ATTENTION_CHUNK_SCORES_BYTES
    assert attention_chunks(-1, 2048, rows=1, heads=4) == 1  # 32 MiB of scores: whole
    assert attention_chunks(-1, 8192, rows=4, heads=32) == 8192 // ATTENTION_CHUNK_MIN_QUERIES  # not under the minimum
    assert attention_chunks(-1, 1000, rows=4, heads=32) == 2  # equal chunks: 500 queries, at most 512
    assert attention_chunks(300, 2048, rows=4, heads=32) == 8  # at most 300 queries: 256
    assert attention_chunks(0, 2048, rows=4, heads=32) == 1
