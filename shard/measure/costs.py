"""The analytic cost model of a layout: parameter bytes per device, bytes per step on each mesh axis,
activation memory (FLOPs: shard.measure.flops). Pure functions of the model's hyperparameters, the mesh axis sizes and the
rule tables; docs/formulas.md derives each formula. `shard.measure.analysis` checks them against the compiled
step, `shard.measure.plan` uses them to rank layouts.

Mesh axes covered: data (DP), fsdp (ZeRO-3), model (Megatron TP), context (ring attention over one
mesh axis) and expert (a mixture of experts' all-to-all), and their products, but for a mixture of
experts with tensor or context parallelism; under pipeline parallel (stage) what the schedule's
executor moves on stage, data, fsdp and model (`pipeline_passes`, `_stage_bytes`). Megatron-sequence
parallelism has no formulas yet. `unmodelled_axes` names the axes for which no minimum is claimed: those
without a formula, and a pipeline's but data (its counts are the executor's, not a floor).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from shard.axes import (BATCH, CONTEXT, DATA, EXPERT, EXPERT_AXIS, FSDP, HEADS, KV_HEADS, LENGTH, MLP,
                        MODEL, RES_LENGTH, STAGE, VOCAB)
from shard.config.model import ModelConfig
from shard.config.params import head_params
from shard.config.precision import fp8_gathered
from shard.hardware import lowers_ragged_all_to_all
from shard.sharding.decisions import (attention_backend, axes_table, cudnn_attention_problem,
                                      head_vocab_split_axes, loss_chunks, stored_lookup_axes)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@functools.lru_cache(maxsize=1)
def _default_rules() -> tuple[dict, dict]:
    from shard.sharding.mesh import load_preset

    base = load_preset("default")
    return dict(base.rules), dict(base.param_rules)


def wire_bytes(kind: str, size: float, n: int) -> float:
    """Bytes one device sends for one collective on a ring of n devices (an all-reduce is a
    reduce-scatter and an all-gather). `size` is the all-reduce buffer, the all-gather output, the
    reduce-scatter input, the all-to-all buffer, the permute buffer. Over `size`: the bus factor."""
    if n < 2:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * size
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * size
    return float(size)  # collective-permute


def axis_share(sizes: dict[str, int], axis: str) -> float:
    """The fraction of a collective over several mesh axes at once (`sizes`) that one axis carries:
    in proportion to (n - 1), 1 for a single axis."""
    if len(sizes) == 1:
        return 1.0
    return (sizes[axis] - 1) / sum(n - 1 for n in sizes.values())


@dataclass(frozen=True)
class LayoutShape:
    """Mesh axis sizes and the rules that place logical axes on them: all a cost formula needs."""

    sizes: dict[str, int]  # mesh axis -> size
    rules: dict[str, tuple[str, ...]]  # activations (and parameters)
    param_rules: dict[str, tuple[str, ...]] = field(default_factory=dict)  # parameters only, on top

    @classmethod
    def from_layout(cls, layout) -> LayoutShape:
        return cls(dict(layout.axis_sizes), dict(layout.rules), dict(layout.param_rules))

    @classmethod
    def of(cls, **sizes: int) -> LayoutShape:
        """Default rules (shard/meshes/default.toml) on a mesh with these axis sizes."""
        rules, param_rules = _default_rules()
        return cls(dict(sizes), dict(rules), dict(param_rules))

    def table(self, param: bool) -> dict[str, tuple[str, ...]]:
        # computed once per shape (the planner asks thousands of times); the shape is not changed after
        return self._tables[param]

    @functools.cached_property
    def _tables(self) -> dict[bool, dict[str, tuple[str, ...]]]:
        return {p: axes_table(self.sizes, self.rules, self.param_rules if p else {}) for p in (False, True)}

    def ways(self, logical_axes: tuple[str, ...], *, param: bool) -> dict[str, int]:
        """Mesh axes (with sizes) that split a tensor with these logical axes; a mesh axis splits one dim."""
        table, used = self.table(param), {}
        for name in logical_axes:
            for a in table.get(name, ()):
                used.setdefault(a, self.sizes[a])
        return used

    def degree(self, logical: str, *, param: bool = False) -> int:
        return math.prod(self.sizes[a] for a in self.table(param).get(logical, ()))

    def token_ways(self) -> int:
        """Devices a step's tokens are split over: the batch ways times the sequence (context) ways."""
        return self.degree(BATCH) * self.degree(LENGTH)

    def divisibility_problems(self, cfg: ModelConfig, global_batch: int, microbatches: int = 1,
                              seq_len: int | None = None) -> list[str]:
        """Why this layout cannot hold the model (each sharded dimension must split evenly)."""
        params: dict[tuple[str, int, int], list[str]] = {}  # (logical, size, ways) -> the parameters
        table = self.table(True)
        for name, shape, axes in cfg.param_shapes():
            used: set[str] = set()
            for n, logical in zip(shape, axes):
                ways = math.prod(self.sizes[a] for a in table.get(logical, ()) if a not in used)
                used |= set(table.get(logical, ()))
                if n % ways:
                    params.setdefault((logical, n, ways), []).append(name)
        problems = [f"{names[0]} dimension {logical}={n} does not split {ways} ways" if len(names) == 1 else
                    f"dimension {logical}={n} does not split {ways} ways ({len(names)} parameters)"
                    for (logical, n, ways), names in params.items()]
        b = self.degree(BATCH) * microbatches
        if global_batch % b:
            problems.append(f"global batch {global_batch} does not split over {b} data-parallel devices")
        if seq_len is not None and seq_len % (c := self.degree(LENGTH)):
            problems.append(f"sequence length {seq_len} does not split over {c} context-parallel devices")
        return problems


@dataclass(frozen=True)
class Workload:
    """What one step processes, and in which dtypes."""

    global_batch: int  # sequences per optimizer step
    seq_len: int
    param_bytes: int = 4  # parameter (and gradient, optimizer moment) dtype
    act_bytes: int = 2  # compute dtype of activations
    microbatches: int = 1
    remat: str = "none"
    # XLA's attention materialises the probabilities (N x T per token); cuDNN's flash attention keeps
    # only their normaliser.
    attention_probs: bool = True
    # Under pipeline parallelism: "1f1b" runs the head on the last stage inside the schedule, so the
    # weights outside the layers (the embedding, tied or not, and the final norm) take their gradient
    # on two stages and are reduced over stage and data at once; GPipe runs the head on every stage
    pipeline_schedule: str = "gpipe"
    pipeline_microbatches: int = 1  # pipeline.microbatches: what flows through the stages (M)
    virtual_stages: int = 1  # pipeline.virtual_stages: chunks of layers a stage holds (V, interleaved)
    # XLA:CPU lowers `ragged_dot` (dropless routing) to a dense matmul over every expert of masked rows,
    # which it materialises; on GPUs it is a grouped matmul that does not (shard.measure.memory).
    masked_ragged_dot: bool = False
    # GPUs and TPUs move dropless routing's tokens by ragged all-to-all, which sends the rows routed;
    # XLA:CPU sends every token to every device (parallel.expert_exchange.expert_exchange)
    ragged_exchange: bool = False
    optimizer: str = "adamw"  # optimizer.name: AdamW keeps two moments per parameter, Muon one on its matrices
    # The weights (paths) whose FSDP gathers move float8 bytes, 1 per element: quantized where stored
    # (precision.fp8_gathered); their gradients are reduced in the compute dtype as the others'
    fp8_gathered: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg, platform: str = "gpu") -> Workload:
        m = cfg.model
        compute = m.compute_dtype_on(platform)
        return cls(cfg.data.batch, cfg.data.seq_len, DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[compute],
                   cfg.data.microbatches, m.remat_on(platform),
                   attention_probs=keeps_attention_probs(m, platform, compute, cfg.data.packing == "packed"),
                   pipeline_schedule=cfg.pipeline.schedule, pipeline_microbatches=cfg.pipeline.microbatches,
                   virtual_stages=cfg.pipeline.virtual_stages, optimizer=cfg.optimizer.name,
                   fp8_gathered=fp8_gathered(cfg.precision, m), **dropless_lowering(platform))


def dropless_lowering(platform: str) -> dict:
    """The Workload fields that say how `platform` runs dropless routing: `ragged_dot` as a masked dense
    matmul (XLA:CPU), and the expert-parallel exchange by ragged all-to-all (GPU, TPU)."""
    return {"masked_ragged_dot": platform == "cpu", "ragged_exchange": lowers_ragged_all_to_all(platform)}


def keeps_attention_probs(cfg: ModelConfig, platform: str, compute_dtype: str, packed: bool = False) -> bool:
    """Whether the model's attention on `platform` ("gpu" taken as NVIDIA) materialises its probabilities:
    every implementation does but cuDNN's flash attention (sharding.decisions.attention_backend), which
    packed rows (`packed`) do not run."""
    problem = cudnn_attention_problem(platform="cuda" if platform == "gpu" else platform, dtype=compute_dtype,
                                      head_dim=cfg.head_dim, segments=packed)
    return attention_backend(cfg.attention, problem) != "cudnn"


def param_bytes(cfg: ModelConfig, shape: LayoutShape, dtype_bytes: int, *, compute: bool = False) -> float:
    """Parameter bytes one device holds (compute=False) or computes with (compute=True: FSDP gathered)."""
    total = 0.0
    for _, dims, axes in cfg.param_shapes():
        total += math.prod(dims) * dtype_bytes / math.prod(shape.ways(axes, param=not compute).values())
    return total


def stored_lookup(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> dict[str, int]:
    tokens = _lookup_tokens(work)
    return stored_lookup_axes(cfg.padded_vocab, tokens, shape.sizes, shape.rules, shape.param_rules)


def loss_chunk_count(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> int:
    """The chunks the loss takes a microbatch's positions in on this layout (`loss_chunks`)."""
    return loss_chunks(cfg, work.global_batch // work.microbatches, work.seq_len, shape.degree(BATCH),
                       shape.degree(LENGTH), shape.degree(VOCAB))


def head_split(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> dict[str, int]:
    """Mesh axes over which the untied head's loss splits the vocabulary instead of the batch
    (`head_vocab_split_axes`)."""
    return head_vocab_split_axes(cfg, _lookup_tokens(work), shape.sizes, shape.rules, shape.param_rules,
                                 loss_chunk_count(cfg, shape, work))


def _lookup_tokens(work: Workload) -> float:
    """Token ids one lookup sees: a microbatch's."""
    return work.global_batch * work.seq_len / work.microbatches


MODELLED_AXES = (DATA, FSDP, MODEL, CONTEXT, EXPERT_AXIS)
_PARALLELISM = {STAGE: "pipeline parallel"}


def unmodelled_axes(shape: LayoutShape, moe: bool = False) -> dict[str, str]:
    """Mesh axes (of size > 1) whose traffic `comm_bytes` leaves out, each with the parallelism that
    moves it: an axis other than data, fsdp, model, context and expert; the axes that split the residual
    stream's length but not the sequence (Megatron-SP turns their all-reduces into reduce-scatters and
    all-gathers, and gathers again in the backward pass); the sequence split over more than one mesh
    axis (a ring over two axes); of a mixture of experts (`moe`), the axes that split its experts' MLP
    or its routing groups (tensor and context parallel), and every axis when the experts are split
    over several mesh axes or over one that does not also split the batch; and under pipeline
    parallelism every axis but data (`comm_bytes` estimates them, as the executor moves them). No
    minimum, so no efficiency, is claimed for them."""
    out = {a: _PARALLELISM.get(a, "no formula") for a, n in shape.sizes.items() if n > 1 and a not in MODELLED_AXES}
    length = shape.table(False).get(LENGTH, ())
    for a in shape.table(False).get(RES_LENGTH, ()):
        if shape.sizes[a] > 1 and a not in length:
            out.setdefault(a, "sequence parallel")
    for a in length if len(length) > 1 else ():
        out.setdefault(a, "context parallel")
    if moe:
        experts, batch = shape.table(False).get(EXPERT, ()), shape.table(False).get(BATCH, ())
        for a in shape.table(False).get(MLP, ()) + length:
            out.setdefault(a, "expert parallel")
        if len(experts) > 1 or (experts and experts[0] not in batch):
            for a, n in shape.sizes.items():
                if n > 1:
                    out.setdefault(a, "expert parallel")
    if shape.sizes.get(STAGE, 1) > 1:  # estimated as the executor moves them (`pipeline_passes`), which is
        for a, n in shape.sizes.items():  # not a minimum (data's one psum ends the schedule: its minimum)
            if n > 1 and a != DATA:
                out.setdefault(a, "pipeline parallel")
    return out


def comm_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload) -> dict[str, float]:
    """Bytes one device sends per optimizer step on each mesh axis (ring algorithms), the minimum for
    this layout:

    - batch axes (data, fsdp): the gradient of each parameter is reduced over the batch axes that do
      not shard it (all-reduce) and reduce-scattered over those that do (FSDP);
    - axes that shard parameters but not their compute (fsdp): each weight is all-gathered for the
      forward pass, and a layer's weights again for the backward pass when remat recomputes it;
    - model: Megatron's all-reduces of (batch, length, embed) activations: two per layer forward
      (attention and MLP outputs), two backward (their input gradients), and the attention output's
      again under full remat; the vocab-parallel embedding lookup and logits add one each, plus three
      (batch, length) float32 reductions for the softmax;
    - context (the sequence split over one mesh axis of n): the gradients all-reduced as over a batch
      axis, and ring attention's key and value blocks passed n - 1 times per layer in each forward pass
      (remat runs it again) and their gradients n - 1 times back;
    - a lookup from the stored table (`stored_lookup_axes`): the ids gathered and the looked-up rows and
      their gradient exchanged all-to-all over the split; an untied table is then neither gathered nor
      its gradient reduced over that split;
    - a head that splits the vocab over that split (`head_split`): the tokens gathered and their gradient
      reduce-scattered over it, the weight and its gradient passed all-to-all between the stored and the
      vocab-split layout, and the softmax's three (batch, length) float32 sums; the head's weight is then
      neither gathered nor its gradient reduced over the split.
    """
    forward_passes = 1 if work.remat == "none" else 2
    lookup = stored_lookup(cfg, shape, work)
    head = head_split(cfg, shape, work)
    token_axes = _token_axes(shape)
    out: dict[str, float] = {}
    for axis, b in [*_parameter_bytes(cfg, shape, work, token_axes, lookup, forward_passes, head),
                    *_lookup_bytes(cfg, shape, work, token_axes, lookup),
                    *_head_split_bytes(cfg, shape, work, token_axes, head),
                    *_tensor_parallel_bytes(cfg, shape, work),
                    *_stage_bytes(cfg, shape, work),
                    *_expert_parallel_bytes(cfg, shape, work, forward_passes),
                    *_ring_attention_bytes(cfg, shape, work, forward_passes)]:
        if b:
            out[axis] = out.get(axis, 0.0) + b
    return out


def _token_axes(shape: LayoutShape) -> list[str]:
    """Every mesh axis that splits a step's tokens: the batch axes, then those of the sequence."""
    batch_axes = list(shape.table(False).get(BATCH, ()))
    length_axes = shape.table(False).get(LENGTH, ())
    return batch_axes + [a for a in length_axes if a not in batch_axes]


def _parameter_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, token_axes: list[str],
                     lookup: dict[str, int], forward_passes: int, head: dict[str, int]):
    """(axis, bytes) of each parameter's FSDP gathers and gradient reduction, parameter by parameter."""
    # The table schedules (1F1B, interleaved, zero-bubble): the weights outside the layers are reduced over
    # stage and data in one all-reduce, whose bytes the axes share in proportion to (n - 1), as the
    # compiled step's are read (`Workload`)
    piped = shape.sizes.get(STAGE, 1) > 1
    head_stages = {STAGE: shape.sizes[STAGE]} if piped and work.pipeline_schedule != "gpipe" else {}
    for name, dims, axes in cfg.param_shapes():
        # Weights are cast to the compute dtype before they are gathered, so gathers and gradient
        # reductions move compute-dtype bytes; norm scales stay in the parameter dtype.
        full = math.prod(dims) * (work.param_bytes if name.endswith("norm") else work.act_bytes)
        stored = shape.ways(axes, param=True)
        computed = shape.ways(axes, param=False)
        compute_bytes = full / math.prod(computed.values())
        gather = {a: n for a, n in stored.items() if a not in computed}
        local = {}
        split = lookup if name == "embed" and not cfg.tie_embeddings else head if name == "unembed" else {}
        if split:
            # read as stored (the lookup) or split on the vocab (the head): not gathered over the split,
            # and its gradient complete in each device's slice
            local = {a: n for a, n in gather.items() if a in split}
            gather = {a: n for a, n in gather.items() if a not in split}
        g = math.prod(gather.values())
        gathered = compute_bytes / work.act_bytes if name in work.fp8_gathered else compute_bytes  # float8
        if piped and name.startswith("layers/"):
            yield from _pipelined_layer_bytes(cfg, shape, work, token_axes, gather, computed, compute_bytes, gathered)
            continue
        # FSDP: a gather per forward pass (remat recomputes only the scanned layers)
        passes = forward_passes if name.startswith("layers/") else 1
        for a, n in gather.items():
            yield a, passes * wire_bytes("all-gather", gathered, n) * axis_share(gather, a)
        # The gradient: reduce-scattered over the gather axes and all-reduced over the other token axes
        # (not over one that splits the parameter as computed: experts over expert), as one logical
        # collective over all of them, its bytes shared between them in proportion to (n - 1), as the
        # compiled step's are read (shard.measure.hlo)
        reduce = {a: shape.sizes[a] for a in token_axes if a not in gather and a not in local and a not in computed}
        if head_stages and name in head_params(cfg):
            # the head runs in the last stage's backward op: there its weights are gathered and their
            # gradient reduce-scattered on every microbatch (M of the S stages' ops, a device's average),
            # and that shard all-reduced over stage and the token axes once, at the end
            per_op = work.pipeline_microbatches / shape.sizes[STAGE]
            at_end = reduce | head_stages
            for a, n in gather.items():
                yield a, per_op * (wire_bytes("all-gather", compute_bytes, n)
                                   + wire_bytes("reduce-scatter", compute_bytes, n)) * axis_share(gather, a)
            for a in at_end:
                yield a, wire_bytes("all-reduce", compute_bytes / g, math.prod(at_end.values())) * axis_share(at_end, a)
            # a tied table is the lookup's too, outside the schedule: its gradient reduced there as without
            # stages, apart from the head's where the table is split (whole, XLA adds the two and reduces once)
            if name != "embed" or not (gather or len(computed) > 0):
                continue
        both = gather | reduce
        b = wire_bytes("reduce-scatter", compute_bytes, g) + wire_bytes(
            "all-reduce", compute_bytes / (g * math.prod(local.values())), math.prod(reduce.values()))
        for a in both:
            yield a, b * axis_share(both, a)


def pipeline_passes(work: Workload, stages: int, n_layers: int) -> dict[str, float]:
    """Per layer of a pipeline stage and per step, a device's average (shard.parallel.pipeline): tensor
    parallel's activation `all_reduces` (each of one microbatch's rows x T x D), the FSDP `gathers` of its
    weights and `reductions` (reduce-scatters) of its gradient, and its `compute` over an unpipelined
    step's forward and backward (3 units a token, the backward 2).

    GPipe runs all M + S - 1 ticks of its loop (idle ones on zeros: its bubble, in the counts) as an
    unpipelined step runs its layers (`comm_bytes`' 4 + r_full all-reduces a layer), and gathers the
    weights of its forward loop once (loop invariant). The table schedules run a forward op (two
    all-reduces and a gather a layer) and a backward op that recomputes its chunk of n layers from the
    stored input (jax.vjp) whose output nothing reads: of that forward, the last layer's MLP output is
    dead (its all-reduce goes), and under full remat, which keeps only each layer's input, the whole last
    layer; remat then runs each layer's forward again in the backward (the attention output's
    all-reduce, a gather). The last virtual stage (1 of V S) has no forward op and keeps its backward's
    forward whole, as the head reads it. Zero-bubble's B and W split that backward with no work done
    twice (shard.parallel.zero_bubble: W reads what B kept): the same counts."""
    M, S, V = work.pipeline_microbatches, stages, work.virtual_stages
    r, rf = work.remat != "none", work.remat == "full"
    if work.pipeline_schedule == "gpipe":
        t = M + S - 1
        return {"all_reduces": (4 + rf) * t, "gathers": 1 + r * t, "reductions": t, "compute": (3 + r) / 3}
    n, last = n_layers / (V * S), 1 / (V * S)  # layers a chunk; the share of virtual stages that run the head
    dead = (1 + rf) / n  # the backward's forward: all-reduces a layer its dead last layer saves
    inner = (2 + (2 - dead) + rf + 2, 1 + (1 - rf / n) + r, 1 + (1 - rf / n) + r + 2)
    head = (4 + rf, 1 + r, 3 + r)
    ars, gathers, compute = ((1 - last) * a + last * b for a, b in zip(inner, head))
    return {"all_reduces": M * ars, "gathers": M * gathers, "reductions": M, "compute": compute / 3}


def _pipelined_layer_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, token_axes: list[str],
                           gather: dict[str, int],
                           computed: dict[str, int], compute_bytes: float, gathered: float):
    """(axis, bytes) of a stacked layer weight under pipeline parallel (`compute_bytes`: the stage's share):
    its FSDP gathers (of `gathered` bytes: float8 where precision.fp8_gathered) and reduce-scatters on
    every pass that needs them (`pipeline_passes`), inside the
    schedule; and its gradient, accumulated in float32 by each data-parallel replica, all-reduced over
    the other token axes once, at the end, as the FSDP shard it is by then."""
    passes = pipeline_passes(work, shape.sizes[STAGE], cfg.n_layers)
    for a, n in gather.items():
        yield a, (passes["gathers"] * wire_bytes("all-gather", gathered, n)
                  + passes["reductions"] * wire_bytes("reduce-scatter", compute_bytes, n)) * axis_share(gather, a)
    reduce = {a: shape.sizes[a] for a in token_axes if a not in gather and a not in computed}
    shard = compute_bytes / math.prod(gather.values()) * work.param_bytes / work.act_bytes
    for a in reduce:
        yield a, wire_bytes("all-reduce", shard, math.prod(reduce.values())) * axis_share(reduce, a)


def _stage_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload):
    """(axis, bytes) of the pipeline's own traffic, a device's average (shard.parallel.pipeline). Per buffer
    of one microbatch's stage input (rows x T x D): the sends, 2 M (V S - 1) / S of them for a table
    schedule (each microbatch crosses each of the V S - 1 boundaries once each way, `Schedule.sends`) and
    2 (M + S - 1)(S - 1) / S for GPipe (every tick of its loop passes a buffer along the chain of S - 1
    links, both ways); the M stage inputs' gradient summed over the stages from stage 0 (GPipe: also its
    outputs from the last stage), one more such sum with a vocab-split table; and with a vocab-split
    table, that table passed twice between layouts over every axis (as compiled: XLA's, not the schedule's)."""
    S = shape.sizes.get(STAGE, 1)
    if S < 2:
        return
    M, V = work.pipeline_microbatches, work.virtual_stages
    vocab_split = shape.degree(VOCAB) > 1
    buffer = work.global_batch * work.seq_len / shape.token_ways() / M * cfg.d_model * work.act_bytes
    gpipe = work.pipeline_schedule == "gpipe"
    sends = 2 * (M + S - 1) * (S - 1) / S if gpipe else 2 * M * (V * S - 1) / S
    sums = 1 + gpipe + vocab_split
    yield STAGE, sends * buffer + sums * wire_bytes("all-reduce", M * buffer, S)
    if vocab_split:
        table = cfg.padded_vocab * cfg.d_model * work.act_bytes / shape.degree(VOCAB)
        split = {a: n for a, n in shape.sizes.items() if n > 1}
        for a in split:
            yield a, 2 * table * axis_share(split, a)


def _lookup_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, token_axes: list[str],
                  lookup: dict[str, int]):
    """(axis, bytes) of a lookup from the stored table: the ids gathered over the split, and the looked-up
    rows (and their gradient) exchanged all-to-all between the split and the batch layout."""
    kept = math.prod(shape.sizes[b] for b in token_axes if b not in lookup)
    tokens = work.global_batch * work.seq_len / kept  # the ids each device looks up in a step
    for a, n in lookup.items():
        yield a, (wire_bytes("all-gather", tokens * 4, n)
                  + 2 * wire_bytes("all-gather", tokens * cfg.d_model / n * work.act_bytes, n))


def _head_split_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, token_axes: list[str],
                      head: dict[str, int]):
    """(axis, bytes) of a head that splits the vocab over `head`'s axes instead of the batch: the tokens
    (x) gathered over the split and their gradient reduce-scattered, the softmax's three float32 sums
    over the split, and the weight and its gradient passed all-to-all between layouts."""
    kept = math.prod(shape.sizes[b] for b in token_axes if b not in head)
    tokens = work.global_batch * work.seq_len / kept  # the tokens the devices of a split's group hold
    weight = cfg.d_model * cfg.padded_vocab / shape.degree(VOCAB) * work.act_bytes
    act = tokens * cfg.d_model * work.act_bytes
    for a, n in head.items():
        yield a, (wire_bytes("all-gather", act, n) + wire_bytes("reduce-scatter", act, n)
                  + 3 * wire_bytes("all-reduce", tokens * 4, n) + 2 * wire_bytes("all-to-all", weight / n, n))


def _tensor_parallel_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload):
    """(axis, bytes) of Megatron's activation all-reduces on the axis that splits the heads."""
    m = shape.degree(HEADS)
    if m > 1:
        model_axis = shape.table(False)[HEADS][0]
        tokens = work.global_batch * work.seq_len / shape.token_ways()
        act = tokens * cfg.d_model * work.act_bytes
        # Full remat recomputes the attention output's all-reduce (the MLP's input needs it), not the
        # MLP output's (that is the layer's output, kept); the dots policies keep both outputs.
        per_layer = 4 + (work.remat == "full")
        n_ar = cfg.n_layers * per_layer
        if shape.degree(VOCAB) > 1:
            # the table schedules run the head on the last of S stages: the logits' input gradient and the
            # softmax's sums; the lookup reads a table passed between layouts instead (`_stage_bytes`)
            tables = shape.sizes.get(STAGE, 1) > 1 and work.pipeline_schedule != "gpipe"
            share = 1 / shape.sizes[STAGE] if tables else 1
            yield model_axis, share * 3 * wire_bytes("all-reduce", tokens * 4, m)
            yield model_axis, share * (1 if tables else 2) * wire_bytes("all-reduce", act, m)
        if shape.sizes.get(STAGE, 1) > 1:  # a stage's layers, on each pass over a microbatch's tokens
            S = shape.sizes[STAGE]
            n_ar = cfg.n_layers / S * pipeline_passes(work, S, cfg.n_layers)["all_reduces"]
            act /= work.pipeline_microbatches
        yield model_axis, n_ar * wire_bytes("all-reduce", act, m)


def _expert_parallel_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, forward_passes: int):
    """(axis, bytes) of a mixture of experts' token exchange over the one mesh axis that splits its experts."""
    experts = shape.table(False).get(EXPERT, ())
    if cfg.n_experts and len(experts) == 1 and cfg.moe_routing == "dropless":
        n = shape.sizes[experts[0]]
        tokens = work.global_batch * work.seq_len / shape.token_ways()
        exchange = dropless_ragged_bytes if work.ragged_exchange else dropless_static_bytes
        yield experts[0], exchange(cfg, n, tokens, work.act_bytes, forward_passes)
    elif cfg.n_experts and len(experts) == 1:
        # each MoE layer's dispatch and combine, all-to-all between rows and experts, forward (again
        # under remat) and their gradients backward; the buffer: every expert's slots of a device's rows
        n = shape.sizes[experts[0]]
        rows = work.global_batch / shape.degree(BATCH)
        buffer = cfg.n_experts * rows * cfg.expert_capacity(work.seq_len) * cfg.d_model * work.act_bytes
        yield experts[0], cfg.moe_layers * 2 * (forward_passes + 1) * wire_bytes("all-to-all", buffer, n)


def _ring_attention_bytes(cfg: ModelConfig, shape: LayoutShape, work: Workload, forward_passes: int):
    """(axis, bytes) of ring attention's key and value blocks, when one mesh axis splits the sequence."""
    length_axes = shape.table(False).get(LENGTH, ())
    if len(length_axes) == 1:
        n = shape.sizes[length_axes[0]]
        kv_block = (work.global_batch * work.seq_len / shape.token_ways() * cfg.n_kv_heads / shape.degree(KV_HEADS)
                    * cfg.head_dim * work.act_bytes)
        yield length_axes[0], cfg.n_layers * (forward_passes + 1) * (n - 1) * 2 * wire_bytes(
            "collective-permute", kv_block, n)


def dropless_row_bytes(cfg: ModelConfig, act_bytes: int, forward_passes: int = 1) -> float:
    """Bytes one token row costs a step each time dropless routing sends it to another device of the
    expert axis (`parallel.expert_exchange.expert_parallel_experts`): the token (D) with its k gates, its k expert ids (int32)
    and the D-wide result back, forward (again under remat); the result's and the row's gradients
    backward."""
    D, K, a = cfg.d_model, cfg.experts_per_token, act_bytes
    forward = (D + K) * a + K * 4 + D * a
    backward = D * a + (D + K) * a
    return forward_passes * forward + backward


def dropless_static_bytes(cfg: ModelConfig, n: int, tokens: float, act_bytes: int, forward_passes: int = 1) -> float:
    """Bytes one device sends per step on an expert axis of n devices for dropless routing by static-shape
    all-to-alls (XLA:CPU: `parallel.expert_exchange.expert_parallel_experts`'s "static" exchange), the minimum for buffers whose
    shape is fixed at compile time and that drop nothing: any of a device's `tokens` tokens may choose
    an expert on any other device, so each destination gets a slot for every token, (n-1) N rows leave
    a device each way. `dropless_ragged_bytes` gives what a ragged all-to-all sends."""
    return cfg.moe_layers * (n - 1) * tokens * dropless_row_bytes(cfg, act_bytes, forward_passes)


def dropless_ragged_bytes(cfg: ModelConfig, n: int, tokens: float, act_bytes: int, forward_passes: int = 1,
                          rows: float | None = None) -> float:
    """What a ragged all-to-all (GPU, TPU: sized by the routing, no padding) sends instead of
    `dropless_static_bytes`: a token only to the other devices holding one of its experts, with
    balanced routing `dropless_remote_devices` of them a token in every layer; or `rows`, the rows one
    device sent over all layers as counted (the `expert_rows_sent` metric over the token devices)."""
    if rows is None:
        rows = cfg.moe_layers * tokens * dropless_remote_devices(cfg.n_experts, cfg.experts_per_token, n)
    return rows * dropless_row_bytes(cfg, act_bytes, forward_passes)


def dropless_remote_devices(n_experts: int, k: int, n: int) -> float:
    """Other devices (of the n holding E/n experts each) a token's k distinct experts live on, on average
    when routing is balanced (each k-subset of experts as likely): the fewest token copies dropless
    routing must send each way. At most k (n-1)/n, the (token, choice) pairs that leave; equal for k=1."""
    stay = math.comb(n_experts - n_experts // n, k) / math.comb(n_experts, k)  # none on a given device
    return (n - 1) * (1 - stay)
