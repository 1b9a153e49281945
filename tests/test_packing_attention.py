"""Packed rows (several whole documents per row, `segment_ids` and `positions` in the batch): every
document's loss is what it is run alone, unpacked, on every attention path and layout (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shard import models
from shard.config.presets import PRESETS
from shard.measure import costs
from shard.models.attention import causal_attention
from shard.parallel.ring_attention import ring_attention, zigzag_positions
from shard.sharding.decisions import attention_backend, cudnn_attention_problem
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.sharding.rules import activation_layout
from shard.testing import devices_for, fake_mesh, tiny_config
from shard.training.state import state_spec
from shard.training.step import batch_sharding, check_batch, make_loss_fn

RTOL = 1e-5
DOCS = 3  # documents per packed row


def packed_batch(rows: int, seq_len: int, vocab: int, seed: int = 0):
    """Rows of DOCS random documents each, then padding, as the data side packs them (the mask is 0 where
    the target crosses into the next document and on padding), and the documents one per row, unpacked
    and padded: row r * DOCS + j is document j of packed row r. Also each packed token's document slot j
    (-1: padding)."""
    rng = np.random.default_rng(seed)
    packed = {k: np.zeros((rows, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    packed["mask"] = np.zeros((rows, seq_len), np.float32)
    alone = {k: np.zeros((rows * DOCS, seq_len), np.int32) for k in ("inputs", "targets")}
    alone["mask"] = np.zeros((rows * DOCS, seq_len), np.float32)
    slot = np.full((rows, seq_len), -1)
    for r in range(rows):
        stream = np.zeros(seq_len + 1, np.int32)  # the row's tokens, the targets read one ahead
        at = 0
        for j, n in enumerate(rng.integers(4, seq_len // DOCS + 1, DOCS)):
            doc = rng.integers(1, vocab, n, dtype=np.int32)
            stream[at:at + n] = doc
            packed["segment_ids"][r, at:at + n] = j + 1
            packed["positions"][r, at:at + n] = np.arange(n)
            packed["mask"][r, at:at + n - 1] = 1
            slot[r, at:at + n] = j
            alone["inputs"][r * DOCS + j, :n] = doc
            alone["targets"][r * DOCS + j, :n - 1] = doc[1:]
            alone["mask"][r * DOCS + j, :n - 1] = 1
            at += n
        packed["inputs"][r], packed["targets"][r] = stream[:-1], stream[1:]
    return packed, alone, slot


def document_losses(cfg, batch: dict, slot: np.ndarray):
    """The summed loss of each document slot j over all rows (through the masks: one compile), and the
    gradients of the whole batch's loss, on cfg's layout (pipelined when the mesh has stages)."""
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    params = jax.device_put(nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=cfg.seed))),
                            spec.shardings["params"])
    loss_fn = make_loss_fn(spec, layout, cfg.pipeline)

    def f(p, b):
        with activation_layout(layout):
            (_, (nll, _, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return nll, grads

    place = lambda b: jax.device_put(b, batch_sharding(layout))  # noqa: E731
    compiled = jax.jit(f).lower(params, place(batch)).compile()
    per_doc = [float(compiled(params, place(dict(batch, mask=batch["mask"] * (slot == j))))[0]) for j in range(DOCS)]
    return np.array(per_doc), jax.device_get(compiled(params, place(batch))[1])


ROWS, SEQ = 8, 32


@pytest.fixture(scope="module")
def alone():
    """Each document run by itself (unpacked, positions 0..), on one device."""
    cfg = tiny_config("1x1", data__batch=ROWS * DOCS, data__seq_len=SEQ)
    _, batch, _ = packed_batch(ROWS, SEQ, cfg.model.vocab_size)
    return document_losses(cfg, batch, np.arange(ROWS * DOCS)[:, None] % DOCS * np.ones((1, SEQ), int))


def assert_same(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=RTOL)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(out[1])[0], jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(np.max(np.abs(r))), err_msg=str(path))


@pytest.mark.parametrize("mesh, sets", [
    ("1x1", {}),  # XLA's attention with a segment mask (auto on CPU)
    ("1x1", {"model__attention": "reference"}),
    ("cp", {}),  # the zig-zag ring: 32 tokens cut into 2 x 4 chunks
    ("sp", {}),
    ("2x4", {}),  # heads split for tensor parallel: the (B, 1, T, T) mask broadcasts over them
    ("fsdp", {}),
    ("stage=2,data=2", {"pipeline__schedule": "gpipe", "pipeline__microbatches": 2}),
    ("stage=2,data=2", {"pipeline__schedule": "1f1b", "pipeline__microbatches": 2}),
])
def test_packed_documents_lose_what_they_lose_alone(mesh, sets, alone):
    cfg = tiny_config(mesh, data__batch=ROWS, data__seq_len=SEQ, **sets)
    packed, _, slot = packed_batch(ROWS, SEQ, cfg.model.vocab_size)
    assert_same(document_losses(cfg, packed, slot), alone)


def test_packed_documents_on_the_plain_ring():
    """36 tokens do not cut into 2 x 4 chunks: the ring in sequence order, segment ids travelling too."""
    seq = 36
    ref_cfg = tiny_config("1x1", data__batch=4 * DOCS, data__seq_len=seq)
    packed, batch, slot = packed_batch(4, seq, ref_cfg.model.vocab_size, seed=1)
    ref = document_losses(ref_cfg, batch, np.arange(4 * DOCS)[:, None] % DOCS * np.ones((1, seq), int))
    assert zigzag_positions(seq, 4) is None
    assert_same(document_losses(tiny_config("cp", data__batch=4, data__seq_len=seq), packed, slot), ref)


def test_the_packed_losses_are_not_trivially_equal(alone):
    # guards the comparison: without the segment ids (documents attending across their boundaries, RoPE
    # at row positions) the same rows lose something else
    cfg = tiny_config("1x1", data__batch=ROWS, data__seq_len=SEQ)
    packed, _, slot = packed_batch(ROWS, SEQ, cfg.model.vocab_size)
    unpacked = {k: packed[k] for k in ("inputs", "targets", "mask")}
    losses = document_losses(cfg, unpacked, slot)[0]
    assert losses[0] == pytest.approx(alone[0][0], rel=RTOL)  # the first documents start their rows
    assert not np.allclose(losses[1:], alone[0][1:], rtol=1e-3)


# --- the attention functions ---------------------------------------------------------------------------


def _segments(B, T, seed=2):
    """Random segment ids: each row cut into a few runs, the last possibly padding (0)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), 3, replace=False))
        seg[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
        seg[b, cuts[-1]:] *= rng.integers(0, 2)  # the last run padding in some rows
    return jnp.asarray(seg)


def _qkv(T=64):
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(kq, (2, T, 4, 16)), jax.random.normal(kk, (2, T, 2, 16)),
            jax.random.normal(kv, (2, T, 2, 16)))


def test_xla_and_reference_attention_agree_on_packed_rows():
    q, k, v = _qkv()
    seg = _segments(2, 64)
    got = causal_attention(q, k, v, "xla", segment_ids=seg)
    np.testing.assert_allclose(got, causal_attention(q, k, v, "reference", segment_ids=seg), atol=2e-5, rtol=2e-5)
    # and a token's output depends on its own segment only: change every other segment's keys and values
    other = seg[:, :, None, None] != seg[:, 40][:, None, None, None]
    k2, v2 = jnp.where(other, 7.0, k), jnp.where(other, -3.0, v)
    np.testing.assert_allclose(causal_attention(q, k2, v2, "xla", segment_ids=seg)[:, 40], got[:, 40], atol=1e-5)


@pytest.mark.parametrize("zigzag", [False, True])
def test_the_rings_with_segments_match_masked_attention_and_its_gradients(zigzag):
    mesh = fake_mesh("data=2,context=4")
    q, k, v = _qkv()
    seg = _segments(2, 64)
    order = zigzag_positions(64, 4) if zigzag else np.arange(64)

    def ring(q, k, v):
        return ring_attention(q[:, order], k[:, order], v[:, order], ("context",), zigzag=zigzag, mesh=mesh,
                              segment_ids=seg[:, order])

    def full(q, k, v):
        return causal_attention(q, k, v, "reference", segment_ids=seg)[:, order]

    np.testing.assert_allclose(jax.jit(ring)(q, k, v), full(q, k, v), atol=2e-5, rtol=2e-5)
    weigh = jax.random.normal(jax.random.key(4), q.shape)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weigh), argnums=(0, 1, 2)))(q, k, v) for f in (ring, full)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# --- cuDNN, the step's programs ------------------------------------------------------------------------


def test_packed_rows_run_xla_attention_where_cudnn_would_run():
    ok = dict(platform="cuda", dtype="bfloat16", head_dim=64)
    assert cudnn_attention_problem(**ok) == ""
    problem = cudnn_attention_problem(**ok, segments=True)
    assert "packed rows" in problem and "\n" not in problem
    assert attention_backend("auto", problem) == "xla"
    # so the cost model counts the probabilities XLA's attention keeps
    assert not costs.keeps_attention_probs(PRESETS["llama-1b"], "gpu", "bfloat16")
    assert costs.keeps_attention_probs(PRESETS["llama-1b"], "gpu", "bfloat16", packed=True)


def test_the_train_step_takes_packed_batches_with_accumulation():
    """The step compiled from `data.packing=packed` (abstract_batch(packed=True)) takes the two extra keys;
    accumulating over two microbatches, it reports the loss the eval step gives the whole packed batch,
    which is the documents' loss alone. The concat step's batch keeps its three keys."""
    from shard.training.compiled import compile_step, lower_step
    from shard.training.state import init_state
    from shard.training.step import make_eval_step, schedule_inputs

    cfg = tiny_config("2x4", data__batch=ROWS, data__seq_len=SEQ, data__microbatches=2, data__packing="packed")
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    compiled = compile_step(cfg, layout, spec)
    packed, _, slot = packed_batch(ROWS, SEQ, cfg.model.vocab_size)
    state = init_state(spec, cfg.model, cfg.seed)
    batch = jax.device_put(packed, batch_sharding(layout))
    nll, count = make_eval_step(spec, layout)(state["params"], batch)
    _, metrics = compiled(state, batch, schedule_inputs(spec, layout))
    np.testing.assert_allclose(float(metrics["loss"]), float(nll / count), rtol=RTOL)
    _, alone, _ = packed_batch(ROWS, SEQ, cfg.model.vocab_size)
    ref_cfg = tiny_config("1x1", data__batch=ROWS * DOCS, data__seq_len=SEQ)
    expected = document_losses(ref_cfg, alone, np.zeros((ROWS * DOCS, SEQ), int))[0][0]
    np.testing.assert_allclose(float(nll), expected, rtol=RTOL)
    concat = lower_step(tiny_config("2x4", data__batch=ROWS, data__seq_len=SEQ), layout, spec)
    assert set(concat.args_info[0][1]) == {"inputs", "targets", "mask"}
