"""Zero-bubble's backward in two: B (the input's gradient, at once) and W (the weights' gradient, later,
in a bubble), with no work done twice.

A weight's gradient needs its matmul's input and its output's gradient; the output gradients come out
of the chain of input gradients from the chunk's last layer back, which B walks. So B keeps, layer by
layer, what the weight gradients still need (matmul inputs among the forward's residuals, output
gradients it computed), and W computes only the weight gradients from them: no forward, no chain.

How, without touching the model: the chunk's pullback (`jax.vjp` of the layer scan) is one reverse scan
over its layers, whose body computes the carry's gradient (the chain) and each layer's weight gradient
(its outputs). The body's jaxpr splits in two by dead-code elimination: B's body, what the carry's
gradient needs, plus as outputs the values W's part reads; W's body, the equations only the weight
gradients need. B runs B's body as the reverse scan, W runs W's body over the layers (`lax.map`).
Where a pullback does not have that shape, `plan` says None and the executor refuses in one line.
"""

import math
from dataclasses import dataclass

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax import lax
from jax.interpreters import partial_eval as pe  # dce_jaxpr (public re-export): which inputs each output needs

from shard.errors import ShardError
from shard.parallel.manual import set_row, vary, varying_axes


@dataclass(frozen=True)
class Plan:
    """The chunk's pullback split. `b_body`, `w_body`: ClosedJaxprs of one layer's step; the rest say
    where their inputs come from (indices into the scan's consts and per-layer residuals)."""

    b_body: jcore.ClosedJaxpr
    w_body: jcore.ClosedJaxpr
    res_of: tuple  # the scan's operands: ("res", i) a pullback leaf, ("g", 0) the incoming gradient
    n_consts: int
    w_consts: tuple[int, ...]  # which scan consts W reads
    w_xs: tuple[int, ...]  # which per-layer residuals W reads
    reverse: bool
    dp_at: tuple[int, ...]  # for each weight leaf, its index among the scan's per-layer outputs


def plan(f, layers, x) -> Plan | None:
    """The split of `jax.vjp(f, layers, x)`'s pullback, traced from shapes; None where the pullback is not
    a single scan whose carry starts at the output's gradient and ends at the input's, and whose
    per-layer outputs are the weights' gradients."""
    box = {}

    def trace(layers, x):
        _, pull = jax.vjp(f, layers, x)
        res, treedef = jax.tree.flatten(pull)
        box["jaxpr"] = jax.make_jaxpr(lambda r, g: jax.tree.leaves(jax.tree.unflatten(treedef, r)(g)))(res, x)
        return res

    jax.eval_shape(trace, layers, x)
    closed = box["jaxpr"]
    jaxpr = closed.jaxpr
    if closed.consts or len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name != "scan":
        return None
    eqn = jaxpr.eqns[0]
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    where = {v: ("res", i) for i, v in enumerate(jaxpr.invars[:-1])} | {jaxpr.invars[-1]: ("g", 0)}
    outs = list(eqn.outvars)
    if (nk != 1 or eqn.params["jaxpr"].consts or eqn.invars[nc] is not jaxpr.invars[-1]
            or any(isinstance(v, jcore.Literal) or v not in where for v in eqn.invars)
            or any(v not in outs for v in jaxpr.outvars) or jaxpr.outvars[-1] is not outs[0]):
        return None
    b_body, w_body, w_consts, w_xs = _split(eqn.params["jaxpr"].jaxpr, nc, nk)
    return Plan(b_body, w_body, tuple(where[v] for v in eqn.invars), nc, w_consts, w_xs,
                eqn.params["reverse"], tuple(outs.index(v) - nk for v in jaxpr.outvars[:-1]))


def _split(body: jcore.Jaxpr, nc: int, nk: int):
    """B's body (carry out first, then what W reads that B computes or receives as the carry) and W's
    body (inputs: the consts it reads, the residuals it reads, then B's extra outputs; outputs: the
    per-layer ones), and which consts and residuals W reads. W keeps its matmuls; an equation of W's
    that B has the inputs for moves to B where that shrinks what W reads (a norm scale's gradient: a
    sum over tokens of two (B, T, D) tensors B has)."""
    ny = len(body.outvars) - nk
    jb, _ = pe.dce_jaxpr(body, [True] * nk + [False] * ny, instantiate=True)
    jw, _ = pe.dce_jaxpr(body, [False] * nk + [True] * ny, instantiate=True)
    in_b = {v for e in jb.eqns for v in e.outvars}
    eqns = [e for e in jw.eqns if not all(v in in_b or isinstance(v, jcore.DropVar) for v in e.outvars)]
    moved, has = [], in_b | set(body.invars)
    for e in list(eqns):
        rest = [x for x in eqns if x is not e]
        if (e.primitive.name != "dot_general" and all(isinstance(v, jcore.Literal) or v in has for v in e.invars)
                and _bytes(_reads(rest, jw.outvars)) <= _bytes(_reads(eqns, jw.outvars))):
            eqns, has = rest, has | set(e.outvars)
            moved.append(e)
    reads = _reads(eqns, jw.outvars)
    pos = {v: i for i, v in enumerate(body.invars)}
    w_consts = tuple(pos[v] for v in reads if v in pos and pos[v] < nc)
    w_xs = tuple(pos[v] - nc - nk for v in reads if v in pos and pos[v] >= nc + nk)
    from_b = [v for v in reads if v not in pos or nc <= pos[v] < nc + nk]
    w_in = [body.invars[i] for i in w_consts] + [body.invars[nc + nk + i] for i in w_xs] + from_b
    # dce_jaxpr dropped the unused outputs: B's are the carry's, W's the per-layer ones
    b_jaxpr = jb.replace(eqns=list(jb.eqns) + moved, outvars=list(jb.outvars) + from_b)
    w_jaxpr = jw.replace(invars=w_in, eqns=eqns)
    return jcore.ClosedJaxpr(b_jaxpr, ()), jcore.ClosedJaxpr(w_jaxpr, ()), w_consts, w_xs


def _reads(eqns, outvars) -> list:
    """The variables `eqns` and `outvars` read that `eqns` do not make, in order."""
    made, reads = {v for e in eqns for v in e.outvars}, []
    for v in [v for e in eqns for v in e.invars] + list(outvars):
        if not isinstance(v, jcore.Literal) and v not in made and v not in reads:
            reads.append(v)
    return reads


def _bytes(variables) -> int:
    return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in variables)


def input_gradient(p: Plan, res: list, g):
    """B: (the input's gradient, what W needs: (consts, per-layer residuals, per-layer B outputs))."""
    args = [res[i] if kind == "res" else g for kind, i in p.res_of]
    consts, carry, xs = args[:p.n_consts], args[p.n_consts], args[p.n_consts + 1:]

    def step(carry, xs):
        out = jcore.jaxpr_as_fun(p.b_body)(*consts, carry, *xs)
        return out[0], out[1:]

    dx, from_b = lax.scan(step, carry, xs, reverse=p.reverse)
    return dx, ([consts[i] for i in p.w_consts], [xs[i] for i in p.w_xs], from_b)


def weight_gradient(p: Plan, kept, treedef):
    """W: the weights' gradient (a tree of `treedef`, stacked by layer) from what B kept."""
    consts, xs, from_b = kept
    ys = lax.map(lambda per_layer: jcore.jaxpr_as_fun(p.w_body)(*consts, *per_layer[0], *per_layer[1]),
                 (xs, from_b))
    return jax.tree.unflatten(treedef, [ys[i] for i in p.dp_at])


# --- in the executor (shard/parallel/pipeline.py) ---------------------------------------------------


def split_ops(run, chunk, add_chunk, first, head_loss, layers, head, aux, sizes, act, everywhere):
    """Zero-bubble's B, W and the last virtual stage's B, as the executor's ops: B keeps, in
    slot m % `waiting` of `kept` (`switch_on_a_slot`), what the layers' gradient still needs, and W
    computes only that gradient from it; the last stage's B runs the head and the loss, once. Returns
    the three ops and the carry they add (zeros). `sizes`: (M, K, waiting)."""
    M, K, waiting = sizes
    split = plan(lambda lp, x: run(lp, x, 0, 0), chunk(layers, 0), act)
    if split is None:
        raise ShardError("pipeline.schedule=zero_bubble: this model's backward does not split into B and W "
                         "(its layers' pullback is not one scan); use pipeline.schedule=1f1b")
    treedef = jax.tree.structure(chunk(layers, 0))

    def b_of(m, ch, x, g_of_y):  # B from the chunk's input: (output, input's gradient, what W needs)
        y, pull = jax.vjp(lambda lp, x: run(lp, x, m, ch), chunk(layers, ch), x)
        dx, kept = input_gradient(split, jax.tree.leaves(pull), g_of_y(y))
        return dx, jax.tree.map(lambda a: vary(a, tuple(sorted(set(everywhere) - varying_axes(a)))), kept)

    kept_like = jax.eval_shape(lambda x: b_of(0, 0, x, lambda y: y)[1], act)
    carry = {"kept": jax.tree.map(lambda a: vary(jnp.zeros((waiting,) + a.shape, a.dtype), everywhere), kept_like)}

    def bwd_input(c, m, ch):  # B: the input's gradient, sent back at once
        u = ch * M + m
        dx, kept = b_of(m, ch, c["xin"][u % K], lambda y: c["gin"][u % K])
        return c | {"kept": kept, "send_b": dx, "dx": set_row(c["dx"], m, dx, first(ch))}

    def bwd_input_last(c, m, ch):  # B on the last virtual stage: the loss, the head's and the input's gradient
        u, out = ch * M + m, {}
        aux_m = jax.tree.map(lambda a: a[m], aux)

        def head_grads(y):
            (out["nll"], out["count"]), vjp = jax.vjp(lambda hp, y: head_loss(hp, y, aux_m), head, y)
            out["g_head"], g_y = vjp((jnp.ones_like(out["nll"]), jnp.zeros_like(out["count"])))
            return g_y

        dx, kept = b_of(m, ch, c["xin"][u % K], head_grads)
        return c | {"kept": kept, "g_head": jax.tree.map(jnp.add, c["g_head"], out["g_head"]), "send_b": dx,
                    "nll": c["nll"] + out["nll"], "count": c["count"] + out["count"]}

    def wgt(c, m, ch):  # W: the layers' gradient from what B kept (m's slot)
        kept = jax.tree.map(lambda b: b[m % waiting], c["kept"])
        return c | {"g_layers": add_chunk(c["g_layers"], weight_gradient(split, kept, treedef), ch)}

    return bwd_input, wgt, bwd_input_last, carry


def switch_on_a_slot(index, ops, c, m, ch, waiting: int, everywhere: tuple[str, ...]):
    """`lax.switch(index, ops, c, m, ch)` for zero-bubble, whose carry's `kept` buffers (a slot for each
    W waiting) go into the conditional to be read (W reads microbatch m's slot) but not out: the ops that
    return a new slot (B's, found while the switch traces them) return it, every other op zeros, and it
    is written to m's slot after. Passed in and out whole, or one slot in and out, they were copied on
    every tick (tiny, S = 4, M = 8, with an earlier and larger kept set: 6.5x and 2.6x 1F1B's step on CPU)."""
    bufs = c["kept"]
    nothing = lambda: jax.tree.map(lambda b: vary(jnp.zeros(b.shape[1:], b.dtype), everywhere), bufs)  # noqa: E731
    writers = set()

    def writes_a_slot(i, op):
        def run(c, m, ch):
            out = op(c, m, ch)
            if out["kept"] is not c["kept"]:
                writers.add(i)
                return out
            return out | {"kept": nothing()}
        return run

    c = lax.switch(index, [writes_a_slot(i, op) for i, op in enumerate(ops)], c, m, ch)  # traces every op
    write = lambda bufs, new: jax.tree.map(lambda b, v: b.at[m % waiting].set(v), bufs, new)  # noqa: E731
    writes = jnp.asarray(sorted(writers))
    return c | {"kept": lax.cond(jnp.any(index == writes), write, lambda bufs, new: bufs, bufs, c["kept"])}
