"""One jitted SPMD train step: next-token loss, gradients (optionally accumulated over microbatches),
the optax update. State is donated; input and output shardings are explicit. The learning-rate
schedule's numbers are arguments of the step (`StateSpec.schedule_args`), so its program does not
change with --steps or lr."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from shard.sharding.decisions import balanced_ring
from shard.axes import BATCH, EMBED, EXPERT, FSDP, LENGTH, MODEL, RES_LENGTH, STAGE
from shard.config.params import head_params
from shard.config.precision import DELAYED
from shard.config.train import GuardConfig, PipelineConfig, TrainConfig
from shard.errors import ShardError
from shard.models import llama, mtp
from shard.models.lora import adapting
from shard.models.xent import head_nll, token_nll  # noqa: F401 (token_nll: the loss on whole logits)
from shard.parallel import pipeline
from shard.parallel.ring_attention import zigzag_positions
from shard.sharding.rules import Layout, activation_layout
from shard.training import lora
from shard.training.optimizers import qk_clip
from shard.training.state import StateSpec

BATCH_KEYS = ("inputs", "targets", "mask")
# Packed rows (data.packing=packed) carry these too, int32 (B, T): the document of each input token
# within its row (1, 2, ...; 0 for padding) and its position within that document.
PACKING_KEYS = ("segment_ids", "positions")
# Fine-tuning batches carry this too, float32 (B, T): 1 where the target is trained on (an assistant
# token), 0 where not; the loss counts the targets where both it and "mask" are 1.
LOSS_MASK = "loss_mask"


def batch_keys(batch: dict) -> tuple[str, ...]:
    """The keys of this batch the step reads: BATCH_KEYS, and PACKING_KEYS and LOSS_MASK where present."""
    return BATCH_KEYS + tuple(k for k in PACKING_KEYS + (LOSS_MASK,) if k in batch)


def target_mask(batch: dict) -> jax.Array:
    """The targets the loss counts: "mask", times LOSS_MASK where the batch has one."""
    return batch["mask"] * batch[LOSS_MASK] if LOSS_MASK in batch else batch["mask"]


def packing_of(batch: dict) -> dict:
    """The packed-row arrays of a batch, as keyword arguments of llama.forward (empty when unpacked)."""
    return {k: batch[k] for k in PACKING_KEYS if k in batch}


def batch_sharding(layout: Layout) -> NamedSharding:
    return layout.sharding((BATCH, LENGTH), what="batch")


def context_order(batch: dict, layout: Layout, cfg) -> tuple[dict, bool]:
    """The batch in ring attention's load-balanced order (`zigzag_positions`) where the layout splits
    the sequence (context parallel), and whether it is. The loss sums over tokens, so their order leaves
    it as it is (`balanced_ring` says where)."""
    seq_len, ways = batch["inputs"].shape[1], layout.degree(LENGTH)
    if not balanced_ring(cfg, seq_len, ways):
        return batch, False
    positions = zigzag_positions(seq_len, ways)
    return {k: v[:, positions] for k, v in batch.items()}, True


def _microbatches(x: jax.Array, m: int, layout: Layout, logical=(BATCH, LENGTH)) -> jax.Array:
    """(B, ...) -> (m, B/m, ...) taking every m-th row, so each device's rows split evenly across
    microbatches and no rows move between devices."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    spec = layout.spec(logical, what="microbatch")
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, PartitionSpec(None, *spec)))


def _whole_batch(x: jax.Array, layout: Layout, logical) -> jax.Array:
    """The inverse of `_microbatches`: (m, B/m, ...) -> (B, ...) in the batch's original row order."""
    x = x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, layout.spec(logical, what="batch")))


def pipeline_stages(layout: Layout) -> int:
    """Pipeline stages of this layout: the size of its `stage` mesh axis (1: not pipelined)."""
    return layout.axis_sizes.get(STAGE, 1)


def make_loss_fn(spec: StateSpec, layout: Layout, pipe: PipelineConfig | None = None):
    """`(params, batch, router_bias=None) -> (objective, (nll, count, moe))`: the summed next-token loss
    plus the weighted MoE auxiliary loss, and `moe` the model's MoE statistics (`llama.run_layers`:
    "aux", and for a MoE model each layer's expert "load", "dropped" and "sent"); through the pipeline schedule
    when the mesh has stages. `router_bias`: the state's balancing bias (model.router_bias_update)."""
    cfg = spec.model
    aux_w = cfg.aux_loss_weight if cfg.n_experts else 0.0
    z_w = cfg.router_z_loss_weight if cfg.n_experts else 0.0

    def plain(params, mb, router_bias=None):
        mb, zigzag = context_order(mb, layout, cfg)
        x_btd, table, moe = llama.forward_hidden(cfg, params, mb["inputs"], zigzag, **packing_of(mb),
                                                 router_bias=router_bias, max_logits=bool(spec.qk_clip))
        nll, count = head_nll(cfg, params, x_btd, mb["targets"], target_mask(mb), table)
        router_loss = aux_w * moe["aux"] + (z_w * moe["z"] if z_w else 0.0)
        if cfg.mtp_depth:  # multi-token prediction: its mean loss weighted, logged as mtp_loss
            if zigzag:
                raise ShardError("model.mtp_depth can't run with context parallelism yet (its modules read the "
                                 "tokens ahead, which the ring's zig-zag order moves); split the batch instead")
            mtp_mean, mtp_aux = mtp.mtp_loss(cfg, params, x_btd, mb["inputs"], mb["targets"], target_mask(mb),
                                             table, **packing_of(mb), router_bias=router_bias)
            router_loss = router_loss + aux_w * mtp_aux + cfg.mtp_loss_weight * mtp_mean
            moe = moe | {"mtp": mtp_mean}
        return nll + router_loss * count, (nll, count, moe)

    if pipeline_stages(layout) == 1:
        return plain
    pipe = pipe or PipelineConfig()
    M = pipe.microbatches
    replicas = pipeline.replica_axes(layout.mesh, jax.tree.map(lambda s: s.spec, spec.shardings["params"]))

    def stage_fn(layers, x_btd, extras_m, first_layer):  # extras_m: the microbatch's packing_of arrays
        # the slice's first layer, which local and global layers alternating (Gemma) need
        return llama.run_layers(cfg, layers, x_btd, **(extras_m or {}),
                                first_layer=first_layer if cfg.windows_vary else 0)[0]

    def head_loss(head, y_btd, aux_m):
        return head_nll(cfg, head, y_btd, aux_m["targets"], aux_m["mask"])

    def piped(params, mb, router_bias=None):  # MoE is not pipelined (pipeline.check): no bias
        x_btd = llama.embed_tokens(cfg, params, mb["inputs"])
        x_mbtd = _microbatches(x_btd, M, layout, (BATCH, RES_LENGTH, EMBED))
        head = {k: params[k] for k in head_params(cfg)}
        extras = {k: _microbatches(v, M, layout) for k, v in packing_of(mb).items()} or None
        if pipe.schedule == "gpipe":
            y_mbtd = pipeline.gpipe_layers(stage_fn, layout.mesh, params["layers"], x_mbtd, replicas, extras)
            # the microbatches back into the batch's own rows (no rows move between devices), so the
            # head runs once: under vmap its custom gradient gave a weight gradient per microbatch, and
            # XLA all-reduced all of them over data (2.1x the minimum)
            y_btd = _whole_batch(y_mbtd, layout, (BATCH, RES_LENGTH, EMBED))
            nll, count = head_loss(head, y_btd, {"targets": mb["targets"], "mask": target_mask(mb)})
        else:
            aux = {k: _microbatches(v, M, layout) for k, v in (("targets", mb["targets"]), ("mask", target_mask(mb)))}
            nll, count = pipeline.one_f_one_b(stage_fn, layout.mesh, M, head_loss, replicas, pipe.schedule,
                                              pipe.virtual_stages)(
                params["layers"], head, x_mbtd, aux, extras)
        return nll, (nll, count, {"aux": jnp.zeros((), jnp.float32)})

    return piped


def make_step_parts(spec: StateSpec, layout: Layout, microbatches: int = 1, guard: GuardConfig | None = None,
                    pipe: PipelineConfig | None = None):
    """The two halves of a step, to be traced inside a jit: `grad_sums(params, batch, router_bias=None)`
    gives gradients, summed next-token loss, token count and the MoE statistics over the batch this
    program sees (not yet normalised; "aux" the auxiliary loss averaged over microbatches, "load" and
    "dropped" counts summed over them), and `apply(state, grads, nll, count, moe, args)` normalises by
    the count, updates with the optimizer of the schedule's numbers `args`, moves the router bias where
    the state has one (`update_router_bias`) and reports metrics. The MPI bridge sums the first half's
    outputs across processes before the second.

    With `guard.action == "skip"`, a step whose loss or gradient norm is not finite (or above
    guard.max_grad_norm) keeps the old params and optimizer state, and reports `skipped = 1`.
    """
    skip_bad = guard is not None and guard.action == "skip"
    grads_of = _with_histories(lora.grad_of_trained(spec, make_loss_fn(spec, layout, pipe)))

    def grad_sums(params, batch, router_bias=None, fp8=None):
        with activation_layout(layout):
            if microbatches == 1:
                (_, (nll, count, moe)), grads = grads_of(params, batch, router_bias, fp8)
            else:
                mbs = {k: _microbatches(batch[k], microbatches, layout) for k in batch_keys(batch)}

                def accumulate(carry, mb):
                    g_acc, nll_acc, n_acc, moe_acc = carry
                    (_, (nll, n, moe)), g = grads_of(params, mb, router_bias, fp8)
                    return (jax.tree.map(jnp.add, g_acc, g), nll_acc + nll, n_acc + n,
                            {k: jax.tree.map(jnp.maximum if k in ("max_logit", "fp8") else jnp.add, moe_acc[k], moe[k])
                             for k in moe_acc}), None

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), spec.trainable(params))
                zeros = jax.lax.with_sharding_constraint(zeros, spec.trainable(spec.shardings["params"]))
                scalar = jnp.zeros((), jnp.float32)
                (grads, nll, count, moe), _ = jax.lax.scan(accumulate, (zeros, scalar, scalar, _stats_start(spec)), mbs)
                moe = moe | {k: moe[k] / microbatches for k in ("aux", "z", "mtp") if k in moe}
        return grads, nll, count, moe

    def apply(state, grads, nll, count, moe, args):
        tx, schedule = spec.optimizer(args)
        params = state["params"]
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
        loss, grad_norm = nll / count, optax.tree.norm(grads)
        with activation_layout(layout):  # Muon orthogonalises whole matrices under it (shard.training.optimizers)
            updates, opt_state = tx.update(grads, state["opt_state"], spec.trainable(params))
        new_params = spec.with_trainable(params, optax.apply_updates(spec.trainable(params), updates))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(schedule_count(state["opt_state"], state["step"])),
                   "tokens": count}
        if spec.qk_clip:  # MuonClip: heads whose logits passed the threshold scaled back to it
            new_params = qk_clip(new_params, moe["max_logit"], spec.qk_clip, spec.model)
            metrics["max_logit"] = jnp.max(moe["max_logit"])
        new_state = {"step": state["step"] + 1}
        metrics |= _layer_metrics(spec, moe)
        if "router_bias" in state:  # the MTP modules' rows (after the layers') are kept as they are
            bias, L = state["router_bias"], spec.model.moe_layers
            new_state["router_bias"] = jnp.concatenate(
                [update_router_bias(bias[:L], moe["load"], spec.model.router_bias_update), bias[L:]])
        if "fp8" in state:  # fp8_delayed: this step's amaxes pushed into the histories
            new_state["fp8"] = moe["fp8"]
        if skip_bad:
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (grad_norm <= guard.max_grad_norm)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
            for key in ("router_bias", "fp8"):
                if key in new_state:
                    new_state[key] = jax.tree.map(keep, new_state[key], state[key])
            metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
        return new_state | {"params": new_params, "opt_state": opt_state}, metrics

    return grad_sums, apply


def _with_histories(grad_fn):
    """grad_fn taking the fp8_delayed weights' amax histories (the state's "fp8", or None) as a fourth
    argument: they join the params as "fp8", and their gradients, which are their updates
    (shard.models.fp8.delayed_einsum), leave the gradients for the statistics' "fp8"."""
    def grads_of(params, mb, router_bias, fp8):
        if fp8 is None:
            return grad_fn(params, mb, router_bias)
        (obj, (nll, n, moe)), grads = grad_fn(params | {"fp8": fp8}, mb, router_bias)
        grads = dict(grads)
        return (obj, (nll, n, moe | {"fp8": grads.pop("fp8")})), grads

    return grads_of


def _layer_metrics(spec: StateSpec, moe: dict) -> dict:
    """The step's metrics of the layer statistics: MTP's loss, the MoE losses and expert loads."""
    metrics = {"mtp_loss": moe["mtp"]} if "mtp" in moe else {}
    if spec.model is not None and spec.model.n_experts:
        metrics["aux_loss"] = moe["aux"] / spec.model.moe_layers  # per layer; 1 when experts are balanced
        if "z" in moe:  # not through the pipeline
            metrics["router_z_loss"] = moe["z"] / spec.model.moe_layers  # per layer
        if "load" in moe:  # not through the pipeline (MoE is not pipelined)
            metrics |= expert_load_metrics(moe["load"], moe["dropped"], spec.model.moe_routing == "capacity",
                                           moe["sent"])
    return metrics


def _stats_start(spec: StateSpec) -> dict:
    """Where the microbatches' layer statistics start adding up: zeros (MoE's aux, z, load, drops and
    rows sent, MTP's loss) and, for the largest attention logit, -inf."""
    scalar = jnp.zeros((), jnp.float32)
    zeros = {"aux": scalar} | ({"mtp": scalar} if spec.model is not None and spec.model.mtp_depth else {})
    if spec.model is not None and spec.model.n_experts:
        L, E = spec.model.moe_layers, spec.model.n_experts
        zeros |= {"load": jnp.zeros((L, E), jnp.float32), "dropped": jnp.zeros((L,), jnp.float32),
                  "sent": jnp.zeros((L,), jnp.float32), "z": scalar}
    if spec.qk_clip:
        zeros["max_logit"] = jnp.full((spec.model.n_layers, spec.model.n_heads), -jnp.inf)
    if "fp8" in spec.abstract:  # amax histories: the largest over microbatches (amaxes are >= 0)
        zeros["fp8"] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec.abstract["fp8"])
    return zeros


def expert_load_metrics(load_le: jax.Array, dropped_l: jax.Array, capacity: bool,
                        sent_l: jax.Array | None = None) -> dict:
    """Step metrics of the (token, choice) pairs each layer routed to each expert (L, E): the least and
    most loaded expert of any layer as a share of its layer's mean (1: balanced), and the coefficient of
    variation over experts averaged over layers; with capacity routing the pairs dropped, all layers;
    with dropless routing the token rows sent to other devices of the expert axis, all layers (`sent_l`:
    what a ragged all-to-all moves each way, forward; 0 without expert parallel)."""
    mean_l1 = jnp.maximum(jnp.mean(load_le, axis=-1, keepdims=True), 1e-9)
    share_le = load_le / mean_l1
    out = {"expert_load_min": jnp.min(share_le), "expert_load_max": jnp.max(share_le),
           "expert_load_cv": jnp.mean(jnp.std(load_le, axis=-1) / mean_l1[:, 0])}
    if capacity:
        out["tokens_dropped"] = jnp.sum(dropped_l)
    elif sent_l is not None:
        out["expert_rows_sent"] = jnp.sum(sent_l)
    return out


def update_router_bias(bias_le: jax.Array, load_le: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free update: each expert's bias moves by `rate` toward balance,
    up where its load is below its layer's mean, down where above (unchanged at the mean)."""
    mean_l1 = jnp.mean(load_le, axis=-1, keepdims=True)
    return bias_le + rate * jnp.sign(mean_l1 - load_le).astype(bias_le.dtype)


def schedule_count(opt_state, step: jax.Array) -> jax.Array:
    """The count the learning-rate schedule reads (optax's ScaleByScheduleState): the updates applied so
    far, which is the train step less any update `guard.action=skip` dropped (a dropped update keeps the
    whole optimizer state, its schedule included). An optimizer of one's own with no such state, or
    several, reports the schedule at the train step."""
    counts = [v for path, v in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
              if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
    return counts[0] if len(counts) == 1 else step


def make_train_step(spec: StateSpec, layout: Layout, microbatches: int = 1, guard: GuardConfig | None = None,
                    pipe: PipelineConfig | None = None):
    """The step `(state, batch) -> (state, metrics)`, jitted once per batch shape; `state` is donated.
    A plain function around the jitted program: for `.lower` or `.trace`, take `jit_train_step` and pass
    `schedule_inputs(spec, layout)` (or `abstract_schedule_inputs`) as its third argument."""
    return with_schedule(jit_train_step(spec, layout, microbatches, guard, pipe), spec, layout)


def jit_train_step(spec: StateSpec, layout: Layout, microbatches: int = 1, guard: GuardConfig | None = None,
                   pipe: PipelineConfig | None = None):
    """make_train_step's program: the jitted `(state, batch, args) -> (state, metrics)`, `args` the
    schedule's numbers (`schedule_inputs` places them); `state` is donated."""
    grad_sums, apply = make_step_parts(spec, layout, microbatches, guard, pipe)

    def step(state, batch, args):
        with adapting(spec.lora, lora.dropout_key(state["step"])):
            return apply(state, *grad_sums(state["params"], batch, state.get("router_bias"), state.get("fp8")), args)

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    data = batch_sharding(layout)  # every key of the batch, with or without PACKING_KEYS
    return jax.jit(
        step,
        in_shardings=(spec.shardings, data, replicated),
        out_shardings=(spec.shardings, replicated),
        donate_argnums=0,
    )


def schedule_inputs(spec: StateSpec, layout: Layout) -> dict:
    """The schedule's numbers as arrays replicated over the mesh, placed once (every process holds the
    same numbers, so each fills its own devices)."""
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return {k: jax.make_array_from_callback((), replicated, lambda _, v=v: np.asarray(v))
            for k, v in spec.schedule_args.items()}


def abstract_schedule_inputs(spec: StateSpec, layout: Layout) -> dict:
    """schedule_inputs' shapes, for lowering."""
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return {k: jax.ShapeDtypeStruct((), np.asarray(v).dtype, sharding=replicated)
            for k, v in spec.schedule_args.items()}


def with_schedule(step, spec: StateSpec, layout: Layout):
    """`step(state, batch, args)` as `(state, batch) -> (state, metrics)`, with this spec's schedule."""
    args = schedule_inputs(spec, layout)
    return lambda state, batch: step(state, batch, args)


def make_eval_step(spec: StateSpec, layout: Layout):
    """The jitted `(params, batch, router_bias=None) -> (summed next-token loss, token count)`, forward
    only. `router_bias` (L, E): the balancing bias a MoE run chooses its experts by
    (model.router_bias_update), so evaluation routes as training does; None (an empty tree to the jit)
    leaves the program as it is without one."""
    def evaluate(params, batch, router_bias):
        with activation_layout(layout), adapting(spec.lora):
            batch, zigzag = context_order(batch, layout, spec.model)
            x_btd, table, _ = llama.forward_hidden(spec.model, params, batch["inputs"], zigzag, **packing_of(batch),
                                                   router_bias=router_bias)
            return head_nll(spec.model, params, x_btd, batch["targets"], target_mask(batch), table)

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    data = batch_sharding(layout)
    step = jax.jit(evaluate, in_shardings=(spec.shardings["params"], data, replicated), out_shardings=replicated)
    return lambda params, batch, router_bias=None: step(params, batch, router_bias)


def abstract_batch(layout: Layout, batch: int, seq_len: int, packed: bool = False, loss_mask: bool = False) -> dict:
    """The batch's shapes for lowering; `packed`: with PACKING_KEYS (data.packing=packed); `loss_mask`:
    with LOSS_MASK (fine-tuning)."""
    data = batch_sharding(layout)
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32, "segment_ids": jnp.int32,
              "positions": jnp.int32, LOSS_MASK: jnp.float32}
    keys = BATCH_KEYS + (PACKING_KEYS if packed else ()) + ((LOSS_MASK,) if loss_mask else ())
    return {k: jax.ShapeDtypeStruct((batch, seq_len), dtypes[k], sharding=data) for k in keys}


def check_batch(cfg: TrainConfig, layout: Layout) -> None:
    """The (micro)batch must split evenly over the data-parallel devices."""
    dp = layout.degree(BATCH)
    m = cfg.data.microbatches
    if cfg.data.batch % (dp * m):
        axes = f" ({layout.describe_axes(BATCH)})" if dp > 1 else ""
        per = f" in each of {m} microbatches" if m > 1 else ""
        raise ShardError(f"global batch {cfg.data.batch} does not divide over {dp} data-parallel devices{axes}{per}; "
                         f"use a batch that is a multiple of {dp * m}")
    for logical in (LENGTH, RES_LENGTH):
        ways = layout.degree(logical)
        if cfg.data.seq_len % ways:
            raise ShardError(f"sequence length {cfg.data.seq_len} does not divide over {ways} devices "
                             f"({layout.describe_axes(logical)}, the mesh axes of {logical!r}); use a multiple "
                             f"of {ways}")
    chunk, ways = cfg.model.loss_chunk, layout.degree(LENGTH)
    if chunk > 0 and (cfg.data.seq_len % chunk or chunk % ways):
        raise ShardError(f"model.loss_chunk={chunk} must divide the sequence length {cfg.data.seq_len}"
                         + (f" and be a multiple of the {ways} ways it is split" if ways > 1 else "")
                         + "; or use -1 (auto) or 0 (off)")
    stages = pipeline_stages(layout)
    if cfg.optimizer.qk_clip and (stages > 1 or layout.degree(LENGTH) > 1):
        raise ShardError("optimizer.qk_clip needs each layer's attention logits in the step: it does not run "
                         "through the pipeline or with context parallelism (`length` split) yet; leave it at 0")
    if stages > 1 and DELAYED in layout.precision.values():
        raise ShardError("precision recipe fp8_delayed does not run through the pipeline yet (its amax histories "
                         "are updated by the plain step's gradient pass); use fp8_tensorwise or fp8_rowwise")
    if stages > 1:
        pipeline.check(cfg.model, stages, cfg.pipeline.microbatches, cfg.data.batch // (dp * m),
                       layout.degree(LENGTH), cfg.pipeline.schedule, cfg.pipeline.virtual_stages)
        sizes = layout.axis_sizes
        if cfg.pipeline.schedule != "gpipe" and sizes.get(FSDP, 1) > 1 and sizes.get(MODEL, 1) > 1:
            # XLA:CPU (jax 0.10.2) aborts the process in its SPMD partitioner on this mesh (a failed check in
            # spmd_partitioner_util.cc: the switch that picks each tick's sends, with fsdp and model inside)
            raise ShardError(f"pipeline.schedule={cfg.pipeline.schedule} with both fsdp and model axes beside the "
                             "stage axis aborts XLA's partitioner; use pipeline.schedule=gpipe on this mesh, or "
                             "drop the fsdp or the model axis")
    experts = layout.degree(EXPERT, param=True)
    if cfg.model.n_experts % experts if cfg.model.n_experts else False:
        raise ShardError(f"{cfg.model.n_experts} experts do not divide over the expert axis ({experts} ways); "
                         "use a multiple of it for model.n_experts")
