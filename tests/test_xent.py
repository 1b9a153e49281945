"""The chunked cross-entropy (shard.models.xent) against the whole logits: the same loss and gradients on
every layout the head runs in, and a step that keeps only one chunk's logits."""

import jax
import numpy as np
import pytest
from flax import nnx

from shard import models
from shard.config.model import ModelConfig
from shard.sharding.decisions import CHUNK_LOGITS_BYTES, CHUNK_MIN_TOKENS, loss_chunks
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.sharding.rules import activation_layout
from shard.testing import devices_for, packed_batch, random_batch, tiny_config
from shard.training.state import state_spec
from shard.training.step import batch_sharding, check_batch, make_loss_fn


def _objective_and_grads(cfg, packed: bool):
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=cfg.seed)))
    params = jax.device_put(params, spec.shardings["params"])
    batch = packed_batch(cfg) if packed else random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size)
    batch = jax.device_put(batch, batch_sharding(layout))
    loss_fn = make_loss_fn(spec, layout, cfg.pipeline)

    def f(p, b):
        with activation_layout(layout):
            (obj, (nll, count, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return obj, nll, count, grads

    return jax.device_get(jax.jit(f)(params, batch))


CASES = {  # mesh, sets, packed rows
    "one-device-untied-padded": ("1x1", {"model__tie_embeddings": False, "model__vocab_size": 250}, True),
    "fsdp-tied": ("fsdp", {"model__vocab_size": 4096}, False),
    # whole, the untied head splits the vocab over fsdp instead of the batch (head_vocab_split_axes)
    "fsdp-untied-vocab-split": ("fsdp", {"model__tie_embeddings": False, "model__vocab_size": 4096}, False),
    "vocab-over-model-untied": ("2x4", {"model__tie_embeddings": False, "model__vocab_size": 1000}, True),
    "fsdp_tp-tied-bf16": ("fsdp_tp:4x2", {"model__compute_dtype": "bfloat16"}, False),
    "context": ("cp", {"data__seq_len": 64}, False),
    "pipeline-1f1b": ("pipeline", {"pipeline__schedule": "1f1b", "data__batch": 16, "model__tie_embeddings": False}, False),
    "pipeline-gpipe": ("pipeline", {"pipeline__schedule": "gpipe", "data__batch": 16}, False),
    "moe-aux": ("ep", {"model__name": "moe-tiny"}, False),
    # Gemma 2: the final norm's (1 + w) scale and soft-capped logits (a cap the logits reach), in chunks too
    "gemma2-softcap": ("fsdp", {"model__name": "gemma2-tiny", "model__vocab_size": 1000, "model__final_softcap": 2.0},
                       True),
}


@pytest.mark.parametrize("name", CASES)
def test_chunked_loss_and_gradients_match_the_whole_logits(name):
    mesh, sets, packed = CASES[name]
    whole = _objective_and_grads(tiny_config(mesh, model__loss_chunk=0, **sets), packed)
    chunked = _objective_and_grads(tiny_config(mesh, model__loss_chunk=8, **sets), packed)
    rtol = 2e-2 if "bf16" in name else 1e-5  # bf16: the weight gradient is summed in float32 across chunks
    for a, b in zip(whole[:3], chunked[:3]):
        np.testing.assert_allclose(b, a, rtol=rtol)
    flat_whole, flat_chunked = jax.tree.leaves_with_path(whole[3]), jax.tree.leaves(chunked[3])
    for (path, a), b in zip(flat_whole, flat_chunked):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * np.abs(a).max(), err_msg=jax.tree_util.keystr(path))


def test_auto_chunks_keep_each_chunks_logits_within_the_budget():
    cfg = ModelConfig(vocab_size=32000, d_model=256)
    assert loss_chunks(cfg, 8, 256, batch_ways=2, vocab_ways=4) == 4  # 4 x 256 x 8000 x 4 B = 31 MiB: 4 of 64
    # 256 tokens per device for an embedding of 256: the weight-gradient sum would cost what chunks save
    assert loss_chunks(cfg, 8, 256, batch_ways=8) == 1
    assert loss_chunks(ModelConfig(vocab_size=256), 8, 32) == 1  # small logits: not chunked
    n = loss_chunks(ModelConfig(vocab_size=32000, d_model=64), 4, 2048)  # 16 positions x 4 rows x 32000 x 4 B: 8 MiB
    assert 2048 % n == 0 and 2048 // n * 4 * 32000 * 4 <= CHUNK_LOGITS_BYTES < 2048 // n * 8 * 32000 * 4
    # chunks of no fewer than CHUNK_MIN_TOKENS tokens, even above the budget
    assert loss_chunks(ModelConfig(vocab_size=32000, d_model=32), 1, 2048) == 2048 // CHUNK_MIN_TOKENS
    # nor fewer tokens than the embedding dim: the reference config on one device (D 256, 2,048 tokens)
    # in 8 chunks of 256, not 32 of 64; llama-1b's vocab and D 2048 at 4 x 2048: D tokens' logits pass
    # CHUNK_LOGITS_MAX_BYTES, so at least the 523 tokens within it, in 8 chunks of 1,024 (not 128 of 64)
    assert loss_chunks(cfg, 8, 256) == 8
    assert loss_chunks(ModelConfig(vocab_size=128256, d_model=2048), 4, 2048) == 8
    assert loss_chunks(ModelConfig(vocab_size=128256, d_model=2048), 1, 2048) == 1  # 2048 tokens, D 2048
    assert loss_chunks(ModelConfig(vocab_size=32000, loss_chunk=0), 8, 256) == 1


def test_evaluation_in_chunks_matches_the_whole_logits():
    """The eval step runs the chunked loss forward only (the custom VJP's primal, no gradient pass)."""
    from shard.training.step import make_eval_step

    out = []
    for chunk in (0, 8):
        cfg = tiny_config("2x4", model__loss_chunk=chunk, model__vocab_size=1000, model__tie_embeddings=False)
        layout = make_layout(cfg, parse_mesh("2x4"), devices_for("2x4"))
        spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
        params = jax.device_put(nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=0))), spec.shardings["params"])
        batch = jax.device_put(packed_batch(cfg), batch_sharding(layout))
        out.append(jax.device_get(make_eval_step(spec, layout)(params, batch)))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5)
