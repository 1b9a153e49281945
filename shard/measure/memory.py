"""The analytic memory model of a layout: bytes per device a step holds (parameters, optimizer state,
gradients, the activations kept for the backward pass) and the HBM traffic of one step. Pure functions
like shard.measure.costs, whose layout shape and workload they take; docs/formulas.md derives each.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from shard.axes import BATCH, EMBED, EXPERT, HEADS, LENGTH, MLP, STAGE, VOCAB
from shard.config.model import ModelConfig
from shard.config.params import model_params, muon_matrix
from shard.measure.costs import LayoutShape, Workload, head_split, loss_chunk_count, param_bytes, stored_lookup
from shard.measure.flops import ffn_slots, scored_keys
from shard.parallel.schedule import build, slots, w_slots
from shard.sharding.decisions import attention_chunks

# Activation bytes kept per token per layer for the backward pass, in units of the compute dtype, by
# the width they scale with. These are fitted, not counted: a minimax fit of XLA:CPU's buffer
# assignment (arguments + temporaries + outputs - aliased) over a grid of tiny and small models on
# DP, FSDP, TP and products at short sequences (tests/test_costs.py keeps those within 10%; from
# sequence 32 to 256 the total runs 7% low to 20% high, docs/formulas.md). q/k/v are
# absorbed in the D term (these models have N x H = D). Accelerator backends fuse more and keep
# fewer buffers, so on GPUs the figures are an upper bound until calibrated there.
ACT_PER_D = 9.0  # residual-stream-wide tensors (x, normed x, attention and MLP outputs, ...)
ACT_PER_F = 7.0  # gate, up, hidden (silu(gate) is recomputed)
ACT_PER_PROBS = 3.25  # attention scores / probabilities, N x T (N with flash attention)
LOGITS_COPIES = 1.5  # float32 logits and their gradient, V per token (the target picked by a gather)
# The loss in chunks (model.loss_chunk, shard.models.xent): one chunk's float32 logits and their gradient,
# V per token of the chunk, and the head weight's float32 gradient sum, D x V, of which XLA's buffers
# hold about half beyond what the unchunked head holds (fitted on tiny, vocab 4096, DP and FSDP x TP).
CHUNK_LOGITS_COPIES = 1.5
CHUNK_WEIGHT_GRAD = 0.5
OPT_TEMP_COPIES = 0.94  # optimizer-step temporaries (clipped gradient, update), parameter-sized
ACT_PER_RING_TICK = 2.0  # ring attention: per tick, the output accumulator (N x H) and the key/value blocks held (2 K x H)
# qk_norm (Qwen3): the queries' and keys' norm in float32 keeps its input and output and RoPE's input,
# (N + K) x H wide; fitted on qwen3-tiny against qwen2-tiny (DP, TP, FSDP x TP: 3.17-3.2).
ACT_PER_QK_NORM = 3.0
# Gemma: the norms after attention and the MLP (sandwich_norms) keep about this many D-wide tensors more
# (fitted on gemma2-tiny with and without them, 8x1 and fsdp_tp:4x2: 4.6-4.7), and soft-capped scores
# (attn_softcap) two more float32 copies of the scores, tanh's input and output (2.00 on both).
ACT_PER_SANDWICH_D = 4.6
SOFTCAP_SCORE_COPIES = 2.0
REMAT_LIVE = 0.6  # with remat, the share of one layer's activations alive while its backward runs
# A mixture of experts' layer in place of the MLP, fitted the same way on moe-tiny variants (data,
# expert and data x expert; sequence 32-128, 4-16 experts, top 1-2, remat none and full: 7% low to
# 7% high). Per expert slot, S = E x C / T of them per token:
ACT_PER_SLOT_D = 5.5  # the dispatched token and the expert's output, D wide
ACT_PER_SLOT_F = 10.0  # the expert's gate, up and hidden, F wide
ACT_PER_ROUTE = 2.5  # routing's dispatch and combine tensors and their one-hots, E x C per token
# Dropless routing (moe.grouped_experts): per (token, choice) row a device runs, K per token of its own,
# n K under expert parallel (the static all-to-all's buffers hold every token of its n-device group), the
# sorted tokens and the experts' outputs (D) and gate, up and hidden (F). XLA:CPU runs `ragged_dot` as a
# dense matmul over every local expert of rows masked by group, so one layer's backward also holds about
# three (rows, local experts, D + F) masked copies (`masked_experts_bytes`). Fitted on moe-fine-tiny,
# mixtral-tiny, qwen3-moe-tiny and deepseek-moe-tiny (data, expert and data x fsdp x expert; 2 and 4
# layers, sequence 32 and 64, remat none and full: 7% low to 8% high; one-layer models run up to 37% high).
ACT_PER_DROPLESS_D = 0.55
ACT_PER_DROPLESS_F = 7.7
MASKED_EXPERTS_D = 2.9
MASKED_EXPERTS_F = 3.1
# Pipeline parallel (`pipeline_activation_bytes`): buffers of one microbatch's stage input per microbatch
# beyond the layers' own activations, fitted on llama-13b-24l at stage=4 (benchmarks/plan_vs_compiled.py)
GPIPE_BUFFERS = 3.0
TABLE_BUFFERS = 4.0
# and about this many copies of one layer's weights or gradient in the compute layout (in the parameter
# dtype) beyond the parameters, FSDP's gathered layer and gradient in flight among them (`_pipeline_layers`)
PIPELINE_LAYERS = 1
# zero-bubble: what B keeps for a waiting W, per layer and token, in (D + F/m) widths, twice under remat
# (fitted on tiny, stage=2 with data or model: 4.9-5.3, and 9.6 with full remat; 3.0 beside fsdp)
ZB_KEPT = 5.0


def activation_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Bytes of activations one device keeps between forward and backward (all microbatches' worth
    at once only for the one being processed); under pipeline parallel (a stage axis) what a stage keeps
    on its schedule (`pipeline_activation_bytes`)."""
    if shape.sizes.get(STAGE, 1) > 1:
        return pipeline_activation_bytes(cfg, shape, work)
    p = _activation_parts(cfg, shape, work)
    return p["tokens"] * (p["kept"] + p["live"]) + p["one_chunk"] + logits_bytes(cfg, shape, work)


def _activation_parts(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> dict[str, float]:
    """The parts of `activation_bytes` for one microbatch: its `tokens` per device; per token, what the
    layers keep for the backward pass (`kept`, all n_layers of them) and what lives only while one layer's
    backward runs (`live`); and one chunk of queries' scores (`one_chunk`, bytes)."""
    m, n = shape.degree(HEADS), shape.degree(LENGTH)
    tokens = work.global_batch * work.seq_len / shape.token_ways() / work.microbatches
    D, F = cfg.d_model, cfg.mlp_dim / shape.degree(MLP)
    # ring attention (context parallel) materialises them, tick by tick; so does the einsum attention
    # soft-capped scores and windows that differ by layer run (Gemma)
    probs = work.attention_probs or n > 1 or bool(cfg.attn_softcap) or cfg.windows_vary
    keys = scored_keys(cfg, work.seq_len, n) if probs else 1
    if cfg.n_experts and cfg.moe_routing == "dropless":
        slots = cfg.experts_per_token * dropless_experts(cfg, shape)[0]
        ffn = slots * (ACT_PER_DROPLESS_D * D + ACT_PER_DROPLESS_F * F)
    elif cfg.n_experts:
        slots = ffn_slots(cfg, work.seq_len)
        ffn = slots * (ACT_PER_SLOT_D * D + ACT_PER_SLOT_F * F) + ACT_PER_ROUTE * slots * work.seq_len
    else:
        ffn = ACT_PER_F * F
    qk_norm = ACT_PER_QK_NORM * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim / m if cfg.qk_norm else 0.0
    sandwich = ACT_PER_SANDWICH_D * D if cfg.sandwich_norms else 0.0
    scores = ACT_PER_PROBS * cfg.n_heads * keys / m * work.act_bytes
    if cfg.attn_softcap:
        scores += SOFTCAP_SCORE_COPIES * cfg.n_heads * keys / m * 4
    # attention in chunks of queries (model.attention_chunk) keeps no scores for the backward pass: one
    # chunk's exist at a time, in one layer's forward or backward
    chunks = query_chunks(cfg, shape, work)
    per_layer = (ACT_PER_D * D + ffn + qk_norm + sandwich) * work.act_bytes + (scores if chunks == 1 else 0.0)
    # ring attention (in float32) keeps each tick's accumulator and blocks, all alive in the layer's backward
    ring = ACT_PER_RING_TICK * n * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim / m * 4 if n > 1 else 0.0
    if work.remat == "none":
        kept, live = cfg.n_layers * (per_layer + ring), 0.0
    else:  # each layer keeps its input and what the policy saves; one layer's activations live in its backward
        kept, live = cfg.n_layers * (D + remat_saved(cfg, shape, work)) * work.act_bytes, REMAT_LIVE * per_layer + ring
    return {"tokens": tokens, "kept": kept, "live": live, "one_chunk": tokens / chunks * scores if chunks > 1 else 0.0}


def pipeline_activation_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Activation bytes of one stage of S running M microbatches (`work.pipeline_microbatches`) through
    its L / (V S) layers a chunk (V: `work.virtual_stages`) on `work.pipeline_schedule`
    (shard.parallel.pipeline). A buffer is one microbatch's stage input, rows x T x D.

    - GPipe differentiates through its loop of M + S - 1 ticks, so it keeps what its layers keep of a
      microbatch on every tick, one layer's backward at a time, and runs the head once on the whole batch;
      besides, the batch's stage inputs and outputs and their gradients (`GPIPE_BUFFERS` x M buffers).
    - The table schedules (1F1B, interleaved, zero-bubble) recompute a chunk from its stored input: K
      slots of inputs and as many of incoming gradients (`schedule.slots`), the M stage inputs, stage 0's
      M input gradients and the sends (`TABLE_BUFFERS` x M buffers), and the backward of one chunk of one
      microbatch with its head and loss (in SPMD every stage compiles the last stage's op)."""
    S, M, V = shape.sizes[STAGE], work.pipeline_microbatches, work.virtual_stages
    one = dataclasses.replace(work, microbatches=work.microbatches * M)
    chunk = dataclasses.replace(cfg, n_layers=cfg.n_layers // (V * S))
    p = _activation_parts(chunk, shape, one)
    buffer = p["tokens"] * cfg.d_model * work.act_bytes
    if work.pipeline_schedule == "gpipe":
        return (p["tokens"] * ((M + S - 1) * p["kept"] + p["live"]) + p["one_chunk"]
                + logits_bytes(cfg, shape, work) + GPIPE_BUFFERS * M * buffer)
    held = 2 * _slots(work.pipeline_schedule, S, M, V)
    # zero-bubble's B keeps, for each W still waiting, what its layers' weight gradients read (matmul
    # inputs, output gradients: shard.parallel.zero_bubble)
    for_w = (_w_slots(S, M) * p["tokens"] * chunk.n_layers * ZB_KEPT * (1 + (work.remat != "none"))
             * (cfg.d_model + cfg.mlp_dim / shape.degree(MLP)) * work.act_bytes
             if work.pipeline_schedule == "zero_bubble" else 0.0)
    return (p["tokens"] * (p["kept"] + p["live"]) + p["one_chunk"] + logits_bytes(cfg, shape, one)
            + (held + TABLE_BUFFERS * M) * buffer + for_w)


def query_chunks(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> int:
    """The chunks of queries the model's attention takes (`attention_chunks`, shard.models.llama): 1 where
    no scores are materialised (flash attention) or ring attention runs (context parallel)."""
    probs = work.attention_probs or bool(cfg.attn_softcap) or cfg.windows_vary
    if shape.degree(LENGTH) > 1 or not probs:
        return 1
    rows = max(work.global_batch // work.microbatches // shape.degree(BATCH), 1)
    return attention_chunks(cfg.attention_chunk, work.seq_len, rows, max(cfg.n_heads // shape.degree(HEADS), 1))


def dropless_experts(cfg: ModelConfig, shape: LayoutShape) -> tuple[int, int]:
    """(n, local experts) of dropless routing per device: under expert parallel (experts split over an
    axis that splits the tokens) a device runs the tokens of the n devices of its expert group on its
    E/n experts; otherwise its own tokens on every expert (gathered at the boundary)."""
    experts = shape.table(False).get(EXPERT, ())
    tokens = set(shape.table(False).get(BATCH, ())) | set(shape.table(False).get(LENGTH, ()))
    n = math.prod(shape.sizes[a] for a in experts) if experts and set(experts) <= tokens else 1
    return n, cfg.n_experts // n


def masked_experts_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Dropless routing where `ragged_dot` lowers to a masked dense matmul (XLA:CPU): the masked copies of
    the rows for every local expert that one layer's backward holds at once, (rows, local experts, D)
    and (rows, local experts, F). GPUs run a grouped matmul that materialises none: 0 there."""
    if not (cfg.n_experts and cfg.moe_routing == "dropless" and work.masked_ragged_dot):
        return 0.0
    tokens = work.global_batch * work.seq_len / shape.token_ways() / work.microbatches
    n, local = dropless_experts(cfg, shape)
    rows = tokens * n * cfg.experts_per_token
    return rows * local * (MASKED_EXPERTS_D * cfg.d_model + MASKED_EXPERTS_F * cfg.mlp_dim) * work.act_bytes


def logits_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Bytes the loss's head holds at once per device: the whole float32 logits and their gradient, or
    in chunks (`loss_chunks`) one chunk's and the float32 sum of the head weight's gradient."""
    tokens = work.global_batch * work.seq_len / shape.token_ways() / work.microbatches
    vocab = cfg.padded_vocab / shape.degree(VOCAB)
    n = loss_chunk_count(cfg, shape, work)
    if n == 1:
        return tokens * LOGITS_COPIES * vocab * 4
    return tokens / n * CHUNK_LOGITS_COPIES * vocab * 4 + CHUNK_WEIGHT_GRAD * cfg.d_model * vocab * 4


def remat_saved(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Elements per token one layer keeps for the backward pass beyond its input under the remat policy:
    "full" nothing; "dots_no_batch" the projections' outputs (q/k/v, attention output, gate/up, down);
    "dots" also attention's two batched matmuls (scores and the weighted values) where XLA's attention
    runs whole (cuDNN's is not a matmul to JAX; a chunk of queries is recomputed, `query_chunks`)."""
    m = shape.degree(HEADS)
    projections = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim / m + 2 * cfg.d_model \
        + 2 * cfg.mlp_dim / shape.degree(MLP) * ffn_slots(cfg, work.seq_len)
    if work.remat == "dots_no_batch":
        return projections
    if work.remat == "dots":
        n = shape.degree(LENGTH)
        probs = (work.attention_probs or n > 1) and query_chunks(cfg, shape, work) == 1  # chunks: recomputed
        return projections + (cfg.n_heads * (scored_keys(cfg, work.seq_len, n) + cfg.head_dim) / m if probs else 0.0)
    return 0.0


def _one_layer(cfg: ModelConfig, shape: LayoutShape, dtype_bytes: int) -> float:
    """Compute-layout bytes of one layer's weights (what FSDP gathers at a time); the stacked layers' own
    axis (split over stage) is not one of its dimensions."""
    return sum(math.prod(d[1:]) * dtype_bytes / math.prod(shape.ways(a[1:], param=False).values())
               for n, d, a in cfg.param_shapes() if n.startswith("layers/"))


def optimizer_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Per-device bytes of the optimizer state, sharded like the parameters: AdamW's two moments of every
    parameter; Muon's one momentum of each matrix it orthogonalises (shard.config.params.muon_matrix)
    and AdamW's two moments of the rest."""
    total = 0.0
    for spec in model_params(cfg).values():
        moments = 1 if work.optimizer == "muon" and muon_matrix(spec.axes, spec.init) else 2
        total += moments * math.prod(spec.shape) * work.param_bytes / math.prod(shape.ways(spec.axes, param=True).values())
    return total


def memory_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> dict[str, float]:
    """Per-device memory of a train step (AdamW or Muon: `work.optimizer`): what XLA's memory analysis
    calls arguments + temporaries + outputs - aliased, in parts. Muon's Newton-Schulz temporaries are
    counted as AdamW's update temporaries (not fitted apart)."""
    pb = work.param_bytes
    params = param_bytes(cfg, shape, pb)
    gathers = any(shape.ways(a, param=True) != shape.ways(a, param=False) for _, _, a in cfg.param_shapes())
    layer = _one_layer(cfg, shape, work.act_bytes)
    tokens = work.global_batch * work.seq_len / shape.token_ways()
    out = {
        "params": params,
        "optimizer": optimizer_bytes(cfg, shape, work),
        # gradients as stored, plus (FSDP) one layer's gradient in the compute layout before its
        # reduce-scatter: the layers are scanned, so one is in flight at a time; a pipeline stage more
        "grads": params + (layer * pb / work.act_bytes if gathers else 0.0)
        + _pipeline_copies(cfg, shape, work, gathers, layer * pb / work.act_bytes),
        "optimizer_temporaries": OPT_TEMP_COPIES * params,
        # FSDP keeps every gathered weight from the forward pass for the backward, unless remat
        # regathers them layer by layer
        "gathered": (0.0 if not gathers else param_bytes(cfg, shape, work.act_bytes, compute=True)
                     - _stored_table_saving(cfg, shape, work) if work.remat == "none" else layer),
        "activations": activation_bytes(cfg, shape, work),
        "masked_experts": masked_experts_bytes(cfg, shape, work),
        "batch": 3 * tokens * 4,
    }
    out["total"] = sum(out.values())
    return out


@functools.lru_cache(maxsize=256)
def _slots(kind: str, S: int, M: int, V: int) -> int:
    return slots(build(kind, S, M, V))


@functools.lru_cache(maxsize=256)
def _w_slots(S: int, M: int) -> int:
    return w_slots(build("zero_bubble", S, M))


def _pipeline_copies(cfg: ModelConfig, shape: LayoutShape, work: Workload, gathers: bool, layer: float) -> float:
    """Bytes of weights or gradients a pipeline stage holds beyond those `memory_bytes` counts: one layer's
    in the compute layout (`layer`, fitted: `PIPELINE_LAYERS` in all with FSDP's gradient in flight and,
    under remat, its gathered layer), and for the interleaved schedule a copy of the stage's layers,
    reordered chunk by chunk on the way in (shard.parallel.pipeline.one_f_one_b)."""
    if shape.sizes.get(STAGE, 1) == 1:
        return 0.0
    copies = max(PIPELINE_LAYERS - (1 + (work.remat != "none") if gathers else 0), 0) * layer
    if work.virtual_stages > 1:
        copies += sum(math.prod(d) * work.param_bytes / math.prod(shape.ways(a, param=True).values())
                      for n, d, a in cfg.param_shapes() if n.startswith("layers/"))
    return copies


def _stored_table_saving(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """Compute-layout bytes of the untied tables never gathered whole: the input table that a stored-table
    lookup reads as stored, the head's weight that a vocab-split head reads split (`head_split`)."""
    if cfg.tie_embeddings:
        return 0.0
    ways = math.prod(shape.ways((VOCAB, EMBED), param=False).values())
    table = cfg.padded_vocab * cfg.d_model * work.act_bytes / ways
    return sum(table * (1 - 1 / math.prod(split.values()))
               for split in (stored_lookup(cfg, shape, work), head_split(cfg, shape, work)) if split)


def probs_hbm_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> float:
    """The share of `hbm_bytes` that is attention's materialised probabilities (where no flash kernel
    fuses them away: XLA's attention, and ring attention tick by tick). Their softmax runs between
    attention's two matmuls and waits on them, so a roofline cannot hide this traffic behind compute."""
    n = shape.degree(LENGTH)
    if not (work.attention_probs or n > 1):
        return 0.0
    tokens = work.global_batch * work.seq_len / shape.token_ways()
    keys = scored_keys(cfg, work.seq_len, n)
    return 2 * tokens * cfg.n_layers * ACT_PER_PROBS * cfg.n_heads * keys / shape.degree(HEADS) * work.act_bytes


def hbm_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, memory: dict[str, float]) -> float:
    """HBM traffic of one step, roughly: weights read per pass, the optimizer's read-modify-write of
    parameters, gradients and moments, and activations written once and read once. Remat keeps fewer
    activations but moves no fewer (the recomputed forward writes them again), so the activations are
    counted as without remat: counting those remat keeps made remat look faster where HBM bounds. A
    pipeline stage reads its weights on every microbatch's pass and moves its L/S layers' activations of
    every token (not the few microbatches' it holds at once)."""
    passes = 3 if work.remat == "none" else 4  # forward, backward (two matmuls), recomputed forward
    stages = shape.sizes.get(STAGE, 1)
    reads = work.microbatches * (work.pipeline_microbatches if stages > 1 else 1)
    weights = param_bytes(cfg, shape, work.act_bytes, compute=True) * passes * reads
    optimizer = memory["params"] * 3 + memory["optimizer"] * 2  # read p, g and the moments; write p and them
    plain = dataclasses.replace(work, remat="none")
    if stages > 1:
        p = _activation_parts(dataclasses.replace(cfg, n_layers=cfg.n_layers // stages), shape, plain)
        moved = p["tokens"] * (p["kept"] + p["live"]) + p["one_chunk"] + logits_bytes(cfg, shape, plain)
    else:
        moved = activation_bytes(cfg, shape, plain)
    return weights + optimizer + 2 * moved * work.microbatches
