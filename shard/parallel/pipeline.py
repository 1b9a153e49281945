"""Pipeline parallelism over the `stage` mesh axis: the stacked layers split into S stages, the batch
into M microbatches, on a GPipe, 1F1B, interleaved or zero-bubble schedule.

Every schedule runs the model's own pieces, passed in by the train step (the layer block as `stage_fn`,
the head and loss as `head_loss`), inside one `jax.shard_map` that is manual over `stage` and the pure data-parallel axes (`replicas`: mesh axes
that split the batch and hold whole copies of the parameters). FSDP and tensor parallelism keep working
on the other mesh axes by their rules.

Why the replica axes are manual: left to the partitioner, the weight gradient of every backward tick is
all-reduced over `data` inside the schedule's loop (the sum over the batch is taken where the gradient
is made), M times per step. Manual, each replica accumulates its own partial gradient and the schedule
ends with one psum over the replica axes. The table schedules' head gradient leaves the schedule summed
over stages only, one copy per replica: with tied embeddings it meets the lookup's gradient in one add,
which XLA:GPU's AllReduceReassociate reduces over the replicas once.

- GPipe: a forward loop of M + S - 1 ticks (each stage applies its layers, then a ppermute passes the
  activations on); `jax.grad` differentiates it, so activations of all M microbatches are kept.
- 1F1B, interleaved, zero-bubble: a static table says, for every tick and stage, idle / forward /
  backward (/ weight gradient) of which microbatch and chunk; a `fori_loop` reads its row and picks the
  op with `lax.switch`. The backward recomputes its chunk (jax.vjp) from a stored input, so a stage
  holds a bounded number of inputs, independent of M. The loss and all gradients come out of one pass,
  wrapped in a custom_vjp so the train step stays `value_and_grad`. Zero-bubble's B and W split that
  backward's work between them (shard/parallel/zero_bubble.py).

The tables (what runs where and when) are data: shard/parallel/schedule.py builds them, and the bubble
(idle share of a stage's time) read from them is the formula's (docs/formulas.md).

Per-microbatch inputs of the layers beyond the activations (`extras`: packed rows' segment ids and
positions, (M, rows, T) each) are not passed along the chain: every stage holds all M of them (they are
small) and reads the microbatch it runs, `stage_fn(layers, x_btd, extras_m, first_layer)`; `extras_m` is None
without them.
"""


import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from shard.axes import DATA, STAGE
from shard.errors import ShardError
from shard.config.model import ModelConfig
from shard.parallel import zero_bubble as zb
from shard.parallel.manual import set_row, vary
from shard.parallel.schedule import BWD, FWD, IDLE, build, slots, w_slots
from shard.parallel.schedule import check as schedule_check
from shard.sharding.rules import mesh_axes_of

# The executor's op codes: the schedule's IDLE, FWD, BWD, WGT, and the last virtual stage's backward, which
# also runs the head and the loss (its weight gradient, zero-bubble's W, reads only what B kept: WGT's op).
BWD_LAST = 4


def check(cfg: ModelConfig, stages: int, microbatches: int, batch_per_replica: int,
          context_ways: int = 1, kind: str = "1f1b", virtual: int = 1) -> None:
    """Errors a user can cause, before anything is traced. `context_ways`: how many ways the layout
    splits `length` (context parallelism)."""
    schedule_check(kind, stages, microbatches, virtual, cfg.n_layers)
    if cfg.n_experts:
        raise ShardError("pipeline: mixture-of-experts models are not pipelined yet; drop the stage axis")
    if cfg.mtp_depth:
        raise ShardError("pipeline: multi-token prediction (model.mtp_depth) is not pipelined yet; drop the stage "
                         "axis or set model.mtp_depth=0")
    if context_ways > 1:
        # Ring attention is a shard_map of its own; Shardy refuses it nested in the stages' (jax 0.10).
        raise ShardError("pipeline: context parallelism (ring attention over `length`) does not run inside "
                         "pipeline stages yet; drop the stage axis or the one `length` maps to")
    if batch_per_replica % microbatches:
        raise ShardError(f"pipeline: the batch ({batch_per_replica} rows per data-parallel replica) does not "
                         f"split into pipeline.microbatches={microbatches}")


# --- schedule tables (numpy, static: shard/parallel/schedule.py) ----------------------------------------


# --- the schedules -------------------------------------------------------------------------------------


def _chain(S: int, step: int) -> list[tuple[int, int]]:
    """ppermute pairs passing each stage's buffer to the next stage (`step` +1) or the one before (-1),
    and not round from the last to the first: what stage 0 received forwards (the last stage backwards)
    was dropped, so a ring sent 1/S more on every tick, and the two end stages' links (across nodes, the
    one path through the whole cluster) carried two buffers where the others carry one."""
    return [(j, j + step) for j in range(S) if 0 <= j + step < S]


def _summed_in_f32_on_cpu(fn, x: jax.Array, mesh) -> jax.Array:
    """`fn(x)` for a psum over manual axes (or a cast whose transpose is one), in float32 on CPU: XLA:CPU
    promotes a bfloat16 all-reduce to float32 anyway, and aborts doing so on these reducers
    (AllReducePromotion: "Invalid binary instruction opcode copy") when the mesh has automatic axes
    beside the manual ones. Elsewhere `fn(x)` as it is."""
    if x.dtype == jnp.float32 or mesh.devices.flat[0].platform != "cpu":
        return fn(x)
    return fn(x.astype(jnp.float32)).astype(x.dtype)


def _from_one_stage(x: jax.Array, mesh) -> jax.Array:
    """Activations that one stage wrote (the others hold zeros), on every stage: a psum over `stage`."""
    return _summed_in_f32_on_cpu(lambda a: lax.psum(a, STAGE), x, mesh)


def replica_axes(mesh, param_specs) -> tuple[str, ...]:
    """The mesh axes a pipeline schedule treats as manual data-parallel replicas: `data` when the mesh
    splits it (more than one way) and no parameter is sharded over it (`param_specs`: the
    PartitionSpecs of the parameters)."""
    if mesh.shape.get(DATA, 1) == 1:
        return ()
    for spec in jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P)):
        if any(DATA in mesh_axes_of(entry) for entry in spec):
            return ()
    return (DATA,)


def _rows(replicas: tuple[str, ...]) -> P:
    """Spec of a (microbatch, rows, ...) array whose rows split over the replica axes."""
    return P(None, replicas or None)


def _microbatch(extras, m):
    """Microbatch m's slice of each per-microbatch array (None without them)."""
    return None if extras is None else jax.tree.map(lambda a: a[m], extras)


def gpipe_layers(stage_fn, mesh, layers: dict, x_mbtd: jax.Array, replicas: tuple[str, ...] = (),
                 extras: dict | None = None) -> jax.Array:
    """The layer stack applied to M microbatches on a GPipe schedule (differentiable). `stage_fn(layers,
    x_btd, extras_m, first_layer) -> y_btd` applies one stage's slice of the stacked layers; `replicas`: the manual
    data-parallel axes (see `replica_axes`); `extras`: per-microbatch inputs of the layers (module
    docstring)."""
    layer_spec = jax.tree.map(lambda _: P(STAGE), layers)

    def body(layers, x_mbtd, extras):
        S, s = lax.axis_size(STAGE), lax.axis_index(STAGE)
        M = x_mbtd.shape[0]
        x_mbtd = _summed_in_f32_on_cpu(vary, x_mbtd, mesh)  # the backward psums its gradient over stages
        # Varying over the replicas: the backward's psum (this cast's transpose) runs once, after the loop.
        layers = jax.tree.map(lambda w: _summed_in_f32_on_cpu(lambda a: vary(a, replicas), w, mesh), layers)
        extras = vary(extras)
        perm = _chain(S, +1)

        def tick(t, carry):
            incoming, out_mbtd = carry
            x_btd = jnp.where(s == 0, x_mbtd[jnp.clip(t, 0, M - 1)], incoming)
            extras_m = None if extras is None else _microbatch(extras, jnp.clip(t - s, 0, M - 1))  # s runs t - s
            y_btd = stage_fn(layers, x_btd, extras_m, s * jax.tree.leaves(layers)[0].shape[0])
            m_out = t - (S - 1)
            write = (s == S - 1) & (m_out >= 0)
            idx = jnp.clip(m_out, 0, M - 1)
            out_mbtd = out_mbtd.at[idx].set(jnp.where(write, y_btd, out_mbtd[idx]))
            return lax.ppermute(y_btd, STAGE, perm), out_mbtd

        init = (jnp.zeros_like(x_mbtd[0]), jnp.zeros_like(x_mbtd))
        _, out_mbtd = lax.fori_loop(0, M + S - 1, tick, init)
        return _from_one_stage(out_mbtd, mesh)  # only the last stage wrote

    rows = _rows(replicas)
    return jax.shard_map(body, mesh=mesh, in_specs=(layer_spec, rows, jax.tree.map(lambda _: rows, extras)),
                         out_specs=rows, axis_names={STAGE, *replicas})(layers, x_mbtd, extras)


def one_f_one_b(stage_fn, mesh, M: int, head_loss, replicas: tuple[str, ...] = (), kind: str = "1f1b", V: int = 1):
    """`f(layers, head, x_mbtd, aux, extras=None) -> (nll, count)` on the table of schedule `kind` (1f1b,
    or interleaved with V virtual stages), differentiable by custom_vjp (in the first three).

    `stage_fn(layers, x_btd, extras_m, first_layer) -> y_btd` applies a slice of the stacked layers whose
    first is the model's layer `first_layer`; `extras`: per-microbatch inputs of the layers (module
    docstring).
    `head_loss(head, y_btd, aux_m) -> (nll, count)` is the model's head and loss for one microbatch
    (aux_m: that microbatch's targets and mask); `head` are its parameters (replicated over stages).
    `replicas`: the manual data-parallel axes (see `replica_axes`); gradients are summed over them once,
    at the end.

    Interleaved: virtual stage v = c * S + s (chunk c of stage s) holds layers [v n, (v + 1) n), n =
    L / (V S). The stacked layers are split over `stage` in order, so they are reordered (stage s's
    chunks together) on the way in and their gradients back on the way out: the weights cross the
    stage axis twice a step, which storing them in chunk order would save.
    """
    body = _one_f_one_b_body(stage_fn, mesh, M, head_loss, replicas, kind, V)
    order = _chunk_order(mesh.shape[STAGE], V)

    def run(layers, head, x_mbtd, aux, extras):
        layer_spec = jax.tree.map(lambda _: P(STAGE), layers)
        rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        per_replica = lambda tree: jax.tree.map(lambda _: P(replicas or None), tree)  # noqa: E731
        rows = _rows(replicas)
        per_row = lambda tree: jax.tree.map(lambda _: rows, tree)  # noqa: E731
        if V > 1:
            layers = jax.tree.map(lambda w: w[order(w.shape[0])], layers)
        nll, count, g_layers, g_head, dx = jax.shard_map(
            body, mesh=mesh, in_specs=(layer_spec, rep(head), rows, per_row(aux), per_row(extras)),
            out_specs=(P(), P(), layer_spec, per_replica(head), rows), axis_names={STAGE, *replicas})(
            layers, head, x_mbtd, aux, extras)
        if V > 1:
            g_layers = jax.tree.map(lambda g: g[np.argsort(order(g.shape[0]))], g_layers)
        return nll, count, g_layers, g_head, dx

    return _loss_with_its_gradients(run)


def _chunk_order(S: int, V: int):
    """`order(L)`: the layer indices stage by stage, each stage's chunks in order (virtual stage c S + s
    holds layers [(c S + s) n, (c S + s + 1) n), n = L / (V S))."""
    def order(L: int) -> np.ndarray:
        n = L // (V * S)
        return np.array([(c * S + s) * n + i for s in range(S) for c in range(V) for i in range(n)])

    return order


def _executed_tables(kind: str, S: int, M: int, V: int) -> tuple[int, int, np.ndarray, list]:
    """(ticks, slots K, table, sends): the table holds, for every tick and stage, the op executed, its
    microbatch and chunk, and the units (chunk * M + microbatch) that arrive from the stage before and
    the stage after (-1: none); `sends`, per tick, the stage pairs that pass something forward and
    backward (Schedule.sends)."""
    sch = build(kind, S, M, V)
    op, mb, ch, sends = sch.op, sch.mb, sch.grid("chunk"), sch.sends()
    # What arrives at tick t: the unit a neighbour sent at t - 1 (-1: nothing).
    recv_f = np.full_like(op, -1)
    recv_b = np.full_like(op, -1)
    for t, pairs in enumerate(sends[:-1]):
        for i, recv in ((0, recv_f), (1, recv_b)):
            for src, dst in pairs[i]:
                v = ch[t, src] * S + src + (1 if i == 0 else -1)  # the virtual stage it feeds
                recv[t + 1, dst] = (v // S) * M + mb[t, src]
    return sch.ticks, slots(sch), np.stack([executed_ops(sch), mb, ch, recv_f, recv_b], -1), sends


def executed_ops(sch) -> np.ndarray:
    """(ticks, stages): the op the executor runs, as its switch is indexed (`_tick_ops`): the last virtual
    stage's forward folded into its backward (which recomputes it anyway), its backward the op that also
    runs the head (BWD_LAST). shard.measure.analysis weighs each branch's collectives by it."""
    op, S = sch.op, sch.stages
    last = (sch.grid("chunk") * S + np.arange(S)) == sch.virtual * S - 1
    return np.select([last & (op == FWD), last & (op == BWD)], [IDLE, BWD_LAST], op)


def _one_f_one_b_body(stage_fn, mesh, M: int, head_loss, replicas: tuple[str, ...], kind: str = "1f1b",
                      V: int = 1):
    """What each device of the shard_map runs: its row of the table, tick by tick, then the sums.
    Returns (nll, count, the layers' gradients, the head's gradient per replica, the input's gradient).

    Sends at the minimum: a tick passes on only what the table sends then (Schedule.sends), so each
    microbatch crosses each boundary once forward and once backward. Which stage pairs send changes from
    tick to tick, and a ppermute's pairs are static: each direction's distinct pair sets become the
    branches of a `lax.switch` whose index is the tick's (the same on every device, so every device
    enters the same branch and its collective), the empty set a branch that sends nothing."""
    S = mesh.shape[STAGE]
    ticks, K, table, sends = _executed_tables(kind, S, M, V)

    def body(layers, head, x_mbtd, aux, extras):
        s = lax.axis_index(STAGE)
        everywhere = (STAGE, *replicas)
        layers = vary(layers, replicas)  # split over stage by its in_spec, rows over the replicas
        head = vary(head, everywhere)
        x_mbtd, aux, extras = vary((x_mbtd, aux, extras), (STAGE,))
        tables = jnp.asarray(table)
        act = x_mbtd[0]
        waiting = w_slots(build(kind, S, M, V)) if kind == "zero_bubble" else 0
        ops, split_carry = _tick_ops(stage_fn, head_loss, s, K, layers, head, x_mbtd, aux, extras, (S, M, V),
                                     waiting, everywhere)

        send_f, send_b = (_sender([p[i] for p in sends], everywhere) for i in (0, 1))
        switch = functools.partial(zb.switch_on_a_slot, waiting=waiting, everywhere=everywhere) if waiting else lax.switch

        def tick(t, c):
            op_t, m, ch, rf, rb = (tables[t, s, i] for i in range(5))
            c = c | {"xin": _put(c["xin"], rf, c["recv_f"], rf >= 0), "gin": _put(c["gin"], rb, c["recv_b"], rb >= 0)}
            c = switch(op_t, ops, c, m, ch)
            return c | {"recv_f": send_f(t, c["send_f"]), "recv_b": send_b(t, c["send_b"])}

        c = lax.fori_loop(0, ticks, tick, _first_carry(layers, head, act, K, M, everywhere) | split_carry)
        # Each stage-summed value is nonzero on one stage only; the replicas each hold a share of the rows.
        # The head's gradient goes out per replica (stacked), summed over them outside (see the docstring).
        total = lambda x: lax.psum(x, everywhere)  # noqa: E731
        like = lambda g, p: jax.tree.map(lambda a, b: a.astype(b.dtype), g, p)  # noqa: E731
        g_layers = jax.tree.map(lambda g: lax.psum(g, replicas), c["g_layers"]) if replicas else c["g_layers"]
        return (total(c["nll"]), total(c["count"]), like(g_layers, layers),
                like(jax.tree.map(lambda g: lax.psum(g, STAGE)[None], c["g_head"]), head),
                _from_one_stage(c["dx"], mesh))

    return body


def _sender(pairs_per_tick: list[tuple[tuple[int, int], ...]], everywhere: tuple[str, ...]):
    """`send(t, x)`: x passed over tick t's stage pairs (zeros where nothing arrives), one `lax.switch`
    branch per distinct pair set, chosen by t alone (so alike on every device)."""
    patterns = sorted(set(pairs_per_tick) - {()})
    index = jnp.asarray([patterns.index(p) + 1 if p else 0 for p in pairs_per_tick], jnp.int32)
    nothing = lambda x: vary(jnp.zeros(x.shape, x.dtype), everywhere)  # noqa: E731
    branches = [nothing] + [functools.partial(lambda x, p: lax.ppermute(x, STAGE, list(p)), p=p) for p in patterns]
    return lambda t, x: lax.switch(index[t], branches, x)


def _tick_ops(stage_fn, head_loss, s, K: int, layers, head, x_mbtd, aux, extras, shape, waiting: int,
              everywhere: tuple[str, ...]) -> tuple[list, dict]:
    """The ops a tick of stage `s` can run, indexed IDLE, FWD, BWD, WGT, BWD_LAST: each takes the carry, a
    microbatch m and a chunk ch, and returns the carry. A forward keeps its input (slot u % K of `xin`,
    u = ch * M + m) and sends its output on; a backward recomputes its chunk from that input (jax.vjp),
    adds its layers' gradient and sends its input's gradient back (virtual stage 0 keeps it, in `dx`);
    the last virtual stage's also runs the head and the loss. `shape`: (S, M, V). `waiting` (zero-bubble:
    the most W's waiting on a stage, else 0): the backward in two, B and W (`zb.split_ops`). Also returns
    the carry those ops add."""
    S, M, V = shape
    n = jax.tree.leaves(layers)[0].shape[0] // V  # layers per chunk

    def chunk(tree, ch):  # the chunk's layers (with V = 1 all of them, the program as before chunks)
        return tree if V == 1 else jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, ch * n, n, 0), tree)

    def add_chunk(acc, g, ch):
        if V == 1:
            return jax.tree.map(jnp.add, acc, g)
        return jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, lax.dynamic_slice_in_dim(a, ch * n, n, 0)
                                                                          + b, ch * n, 0), acc, g)

    def run(lp, x, m, ch):  # the chunk on virtual stage ch * S + s, its layers numbered from there
        return stage_fn(lp, x, _microbatch(extras, m), (ch * S + s) * n)

    first = (lambda ch: s == 0) if V == 1 else (lambda ch: (s == 0) & (ch == 0))  # virtual stage 0

    def head_of(m, ch):  # the last virtual stage's chunk, head and loss for microbatch m
        aux_m = jax.tree.map(lambda a: a[m], aux)
        return lambda lp, hp, x: head_loss(hp, run(lp, x, m, ch), aux_m)

    def idle(c, m, ch):
        return c

    def fwd(c, m, ch):
        u = ch * M + m
        x_btd = jnp.where(first(ch), x_mbtd[m], c["xin"][u % K])
        return c | {"xin": _put(c["xin"], u, x_btd, True), "send_f": run(chunk(layers, ch), x_btd, m, ch)}

    def bwd(c, m, ch):
        u = ch * M + m
        _, vjp = jax.vjp(lambda lp, x: run(lp, x, m, ch), chunk(layers, ch), c["xin"][u % K])
        g_layers, dx = vjp(c["gin"][u % K])
        return c | {"g_layers": add_chunk(c["g_layers"], g_layers, ch), "send_b": dx,
                    "dx": set_row(c["dx"], m, dx, first(ch))}

    def bwd_last(c, m, ch):
        u = ch * M + m
        (nll, count), vjp = jax.vjp(head_of(m, ch), chunk(layers, ch), head, c["xin"][u % K])
        g_layers, g_head, dx = vjp((jnp.ones_like(nll), jnp.zeros_like(count)))
        return c | {"g_layers": add_chunk(c["g_layers"], g_layers, ch),
                    "g_head": jax.tree.map(jnp.add, c["g_head"], g_head), "send_b": dx,
                    "nll": c["nll"] + nll, "count": c["count"] + count}

    if not waiting:
        return [idle, fwd, bwd, idle, bwd_last], {}  # W never runs: its slot an idle branch

    b, w, b_last, carry = zb.split_ops(run, chunk, add_chunk, first, head_loss, layers, head, aux, (M, K, waiting),
                                     x_mbtd[0], everywhere)
    return [idle, fwd, b, w, b_last], carry


def _first_carry(layers, head, act, K: int, M: int, everywhere: tuple[str, ...]) -> dict:
    """The loop's carry at tick 0, zeros varying over every manual axis: the gradients and sums made so
    far, K stored inputs and incoming gradients, the M input gradients of stage 0, and the activations
    and gradients to send and just received."""
    zeros_like = lambda tree: vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree),  # noqa: E731
                                    everywhere)
    buf = lambda n: vary(jnp.zeros((n,) + act.shape, act.dtype), everywhere)  # noqa: E731
    scalar = vary(jnp.zeros((), jnp.float32), everywhere)
    return {
        "g_layers": zeros_like(layers), "g_head": zeros_like(head), "nll": scalar, "count": scalar,
        "xin": buf(K), "gin": buf(K), "dx": buf(M),
        "send_f": buf(1)[0], "send_b": buf(1)[0], "recv_f": buf(1)[0], "recv_b": buf(1)[0],
    }


def _loss_with_its_gradients(run):
    """`run(layers, head, x_mbtd, aux, extras) -> (nll, count, g_layers, g_head per replica, dx)` as
    `(nll, count)`, differentiable by custom_vjp: the backward scales the gradients the forward made."""
    @jax.custom_vjp
    def loss(layers, head, x_mbtd, aux, extras=None):
        nll, count, *_ = run(layers, head, x_mbtd, aux, extras)
        return nll, count

    def loss_fwd(layers, head, x_mbtd, aux, extras=None):
        nll, count, g_layers, g_head, dx = run(layers, head, x_mbtd, aux, extras)
        g_head = jax.tree.map(lambda g: g.sum(0), g_head)
        return (nll, count), (g_layers, g_head, dx, aux, extras)

    def loss_bwd(res, cotangents):
        g_layers, g_head, dx, aux, extras = res
        g = cotangents[0]
        scale = lambda tree: jax.tree.map(lambda a: (a * g.astype(a.dtype)), tree)  # noqa: E731
        zeros = lambda tree: jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(  # noqa: E731
            a.dtype, jnp.floating) else jnp.zeros_like(a), tree)
        return scale(g_layers), scale(g_head), scale(dx), zeros(aux), zeros(extras)

    loss.defvjp(loss_fwd, loss_bwd)
    return loss


def _put(buf, m, value, valid):
    """Slot m % K of a buffer of K slots set to `value` where `valid`."""
    return set_row(buf, m % len(buf), value, valid)
