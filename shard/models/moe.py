"""Mixture-of-experts feed-forward layer: top-k routing, a load-balancing auxiliary loss, SwiGLU experts
and optional shared experts every token goes through (DeepSeek-MoE).

Two ways to run the routed experts (`model.moe_routing`):
- "capacity" (GShard / Switch Transformer): each expert has a fixed number of slots per sequence and
  tokens beyond them are dropped (they keep their residual);
- "dropless" (MegaBlocks, MaxText's megablox, DeepSeek-V3): the (token, choice) pairs are sorted by
  expert and run through grouped matmuls (`jax.lax.ragged_dot`); no token is dropped.

The router's scores are a softmax over the experts or a per-expert sigmoid (DeepSeek-V3); the k chosen
scores are the gates, rescaled to sum to 1 when `router_normalize` (softmax then: Mixtral's softmax
over the k chosen logits) and multiplied by `routed_scale`.

Capacity routing: each sequence is a routing group. Tokens are dispatched into a (experts, batch, capacity, embed)
tensor whose expert dim is pinned to the `expert` logical axis and whose batch dim to `expert_batch`;
when a preset maps `expert` to a mesh axis that also splits the batch, XLA moves tokens between the
two layouts with an all-to-all. Mesh axes never appear here.

Dropless routing runs per device: inside a `jax.shard_map` that is manual over the mesh axes splitting
the tokens, each device sorts its own tokens and multiplies them by every expert (weights split over
an axis that holds the same tokens are gathered at the boundary, as FSDP gathers a weight). Under
expert parallel (`ep`: the expert axis also splits the tokens) the experts stay split and each token
goes to the devices holding its experts by a ragged all-to-all (`expert_parallel_experts`).

Letters: B batch, T length (tokens per group), D embed, E experts, C capacity, F mlp, K experts per
token, N tokens, M = N K (token, choice) pairs, S shared experts' hidden width.
"""

from functools import partial

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from shard.axes import BATCH, EMBED, EXPERT, EXPERT_BATCH, LENGTH, MLP, RES_LENGTH
from shard.config.model import ModelConfig
from shard.hardware import lowers_ragged_all_to_all
from shard.parallel.ragged import ragged_all_to_all
from shard.sharding.rules import active_layout, constrain


def route(probs_bte: jax.Array, k: int, cap: int, choose_bte: jax.Array | None = None, with_load: bool = False):
    """Top-k routing with a capacity per expert and group; experts chosen by `choose_bte` (the scores
    plus the balancing bias) where given, by the probs otherwise.

    Returns dispatch_btec (0/1: token t goes to slot c of expert e), combine_btec (the same, weighted by
    the token's renormalised gate) and the Switch load-balancing loss E * sum_e f_e * P_e (f_e: share
    of first choices going to e, P_e: mean router probability of e), which is 1 when balanced.
    Earlier choices take slots first, then earlier tokens. `with_load`: also the (token, choice) pairs
    routed to each expert (E,), dropped or not (counted from these choices: top_k's, which XLA gathers
    over the token devices to sort, are then left unused and unlowered).
    """
    B, T, E = probs_bte.shape
    remaining_bte = probs_bte if choose_bte is None else choose_bte
    counts_be = jnp.zeros((B, E), jnp.float32)
    chosen_bte = jnp.zeros_like(probs_bte)
    dispatch_btec = jnp.zeros((B, T, E, cap), jnp.float32)
    first_bte = None
    for _ in range(k):
        mask_bte = jax.nn.one_hot(jnp.argmax(remaining_bte, axis=-1), E, dtype=jnp.float32)
        first_bte = mask_bte if first_bte is None else first_bte
        pos_bte = jnp.cumsum(mask_bte, axis=1) - 1.0 + counts_be[:, None, :]
        pos_bt = jnp.sum(pos_bte * mask_bte, axis=-1).astype(jnp.int32)
        slot_btc = jax.nn.one_hot(pos_bt, cap, dtype=jnp.float32)  # all zeros beyond capacity
        dispatch_btec = dispatch_btec + mask_bte[..., None] * slot_btc[:, :, None, :]
        counts_be = counts_be + jnp.sum(mask_bte, axis=1)
        chosen_bte = chosen_bte + mask_bte
        remaining_bte = jnp.where(mask_bte > 0, -jnp.inf, remaining_bte)
    gates_bte = probs_bte * chosen_bte
    gates_bte = gates_bte / jnp.maximum(jnp.sum(gates_bte, axis=-1, keepdims=True), 1e-9)
    combine_btec = dispatch_btec * gates_bte[..., None]
    f_e = jnp.mean(first_bte, axis=(0, 1))
    p_e = jnp.mean(probs_bte, axis=(0, 1))
    aux = E * jnp.sum(f_e * p_e)
    if with_load:
        return dispatch_btec, combine_btec, aux, jnp.sum(counts_be, axis=0)
    return dispatch_btec, combine_btec, aux



def router_logits(h_btd: jax.Array, router_de: jax.Array) -> jax.Array:
    return jnp.einsum("btd,de->bte", h_btd.astype(jnp.float32), router_de.astype(jnp.float32))


def z_loss(logits_bte: jax.Array) -> jax.Array:
    """The router z-loss (ST-MoE): the mean over tokens of logsumexp(logits)^2, which grows with the
    logits' size and so keeps them small (float32 softmaxes stay accurate)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_bte, axis=-1)))


def router_probs(h_btd: jax.Array, router_de: jax.Array) -> jax.Array:
    return jax.nn.softmax(router_logits(h_btd, router_de), axis=-1)


def router_scores(logits_bte: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(scores, probs): the scores experts are chosen by and gated with (a softmax over experts, or a
    sigmoid per expert), and those scores as a distribution over experts for the balancing loss."""
    if cfg.router_scores == "sigmoid":
        scores_bte = jax.nn.sigmoid(logits_bte)
        return scores_bte, scores_bte / jnp.sum(scores_bte, axis=-1, keepdims=True)
    probs_bte = jax.nn.softmax(logits_bte, axis=-1)
    return probs_bte, probs_bte


def top_k_gates(scores_bte: jax.Array, cfg: ModelConfig, bias_e: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """(gates_btk, experts_btk): each token's k highest-scoring experts, best first, and their gates.
    With a balancing bias (auxiliary-loss-free balancing, DeepSeek-V3) the experts are those of the k
    highest scores + bias, and their gates the scores alone."""
    if bias_e is None:
        gates_btk, experts_btk = per_device_top_k(scores_bte, cfg.experts_per_token)
    else:
        _, experts_btk = per_device_top_k(scores_bte + bias_e, cfg.experts_per_token)
        gates_btk = jnp.take_along_axis(scores_bte, experts_btk, axis=-1)
    if cfg.router_normalize:
        gates_btk = gates_btk / jnp.maximum(jnp.sum(gates_btk, axis=-1, keepdims=True), 1e-9)
    return gates_btk * cfg.routed_scale, experts_btk


def per_device_top_k(scores_bte: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the experts, each device on its own tokens: left to the partitioner, the
    scores of every token device were all-gathered to be sorted (moe-fine-tiny on `ep`: 57 KB a step
    over data x expert, a quarter of the expert axis' traffic beyond the all-to-alls)."""
    batch, length = _token_axes()
    if not batch and not length:
        return jax.lax.top_k(scores_bte, k)
    spec = P(batch or None, length or None)
    fn = jax.shard_map(lambda s: tuple(jax.lax.top_k(s, k)), mesh=active_layout().mesh, in_specs=spec,
                       out_specs=(spec, spec), axis_names=set(batch + length))
    return fn(scores_bte)


def expert_load(experts_btk: jax.Array, n_experts: int) -> jax.Array:
    """(E,) float32: the (token, choice) pairs routed to each expert, whether or not a capacity drops them.
    A sum of comparisons, which splits over the tokens' devices (partial sums, one all-reduce of E
    numbers); a bincount's scatter gathered the choices of every device (an all-gather under `ep`)."""
    hits_btke = experts_btk[..., None] == jnp.arange(n_experts, dtype=experts_btk.dtype)
    return jnp.sum(hits_btke, axis=tuple(range(experts_btk.ndim)), dtype=jnp.float32)


def balance_loss(experts_btk: jax.Array, probs_bte: jax.Array) -> jax.Array:
    """The Switch load-balancing loss E * sum_e f_e * P_e, as `route` computes it."""
    E = probs_bte.shape[-1]
    f_e = jnp.mean(jax.nn.one_hot(experts_btk[..., 0], E, dtype=jnp.float32), axis=(0, 1))
    return E * jnp.sum(f_e * jnp.mean(probs_bte, axis=(0, 1)))


def grouped_experts(x_nd: jax.Array, experts_nk: jax.Array, gates_nk: jax.Array, w_gate_edf: jax.Array,
                    w_up_edf: jax.Array, w_down_efd: jax.Array) -> jax.Array:
    """Dropless: each token's sum over its k choices of gate * expert(token), by grouped matmuls.

    The N K (token, choice) pairs are sorted by expert (stably), so each expert's rows form one
    contiguous group of `ragged_dot`; the results return to their pairs by the inverse permutation."""
    N, K = experts_nk.shape
    E = w_gate_edf.shape[0]
    expert_m = experts_nk.reshape(N * K)
    order_m = jnp.argsort(expert_m, stable=True)  # sorted row i is pair order_m[i]
    sizes_e = jnp.bincount(expert_m, length=E).astype(jnp.int32)  # rows of each expert's group
    x_md = x_nd[order_m // K]  # (M, D) tokens in expert order
    gate_mf = jax.lax.ragged_dot(x_md, w_gate_edf, sizes_e)
    up_mf = jax.lax.ragged_dot(x_md, w_up_edf, sizes_e)
    y_md = jax.lax.ragged_dot(jax.nn.silu(gate_mf) * up_mf, w_down_efd, sizes_e)
    y_nkd = y_md[jnp.argsort(order_m)].reshape(N, K, -1)  # back in (token, choice) order
    return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y_nkd.dtype))


def _token_axes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes that split the residual stream's batch and length in the layout being traced, for
    dropless routing's per-device shard_map. None outside a layout, or inside another shard_map
    (pipeline stages), where the partitioner places the routing as it would any op."""
    layout = active_layout()
    if layout is None or jax.sharding.get_abstract_mesh().manual_axes:
        return (), ()
    batch = layout.mesh_axes(BATCH)
    return batch, tuple(a for a in layout.mesh_axes(RES_LENGTH) if a not in batch)


def _expert_axes(token_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes that split the experts, when each of them also splits the tokens (`ep`: expert is
    a batch axis outside the MoE layers): dropless routing then moves tokens to the experts. Experts
    split over an axis that holds the same tokens stay gathered at the shard_map's boundary."""
    experts = active_layout().mesh_axes(EXPERT)
    return experts if experts and set(experts) <= set(token_axes) else ()


def expert_exchange(platform: str) -> str:
    """How dropless routing's tokens move under expert parallel (`expert_parallel_experts`) on `platform`:
    "ragged" by `jax.lax.ragged_all_to_all` (GPUs, TPUs); "static" by all-to-alls of every token to
    every device (XLA:CPU, which has no ragged all-to-all). A third, "padded-ragged", is the ragged path
    with the op's padded twin (`shard.parallel.ragged`), which runs it on XLA:CPU: the tests' way to
    check the GPU path (it moves the static bytes, more slowly)."""
    return "ragged" if lowers_ragged_all_to_all(platform) else "static"


def expert_parallel_experts(x_nd, experts_nk, gates_nk, w_gate_edf, w_up_edf, w_down_efd,
                            axes: tuple[str, ...], exchange: str) -> tuple[jax.Array, jax.Array]:
    """Dropless routing with the experts split over the manual mesh `axes` (this device holds E/n of
    them): tokens go to the devices that hold their experts, with their k expert ids and gates; there
    `grouped_experts` runs the choices that device holds (its own experts' ids) and their gated sum
    comes back, summed per token. `exchange` (`expert_exchange`) says how they move: each token once to each
    device holding one of its experts (ragged: about N r rows a device each way, r the other devices a
    token's experts live on, `costs.dropless_remote_devices`), or every token to every device (static:
    (n-1) N rows, the fewest static buffers that drop nothing can hold). Returns the output (N, D) and
    the rows a ragged exchange sends from this device to others (float32), whichever ran."""
    n = jax.lax.psum(1, axes)
    local = w_gate_edf.shape[0]  # experts on this device
    me = jax.lax.axis_index(axes)
    to_jn = jnp.any((experts_nk // local)[None] == jnp.arange(n)[:, None, None], axis=-1)  # token n goes to j
    sent = (jnp.sum(to_jn) - jnp.sum(to_jn[me])).astype(jnp.float32)
    weights = (w_gate_edf, w_up_edf, w_down_efd)
    if exchange == "static":
        out_nd = _static_exchange(x_nd, experts_nk, gates_nk, weights, axes, n, local * me)
    else:
        out_nd = _ragged_exchange(x_nd, experts_nk, gates_nk, weights, axes, local * me, to_jn, exchange == "padded-ragged")
    return out_nd, sent


def _local_experts(rows_mc, ids_mk, weights, first: jax.Array) -> jax.Array:
    """`grouped_experts` on the received rows (D values then K gates) for the choices this device holds,
    experts first .. first + local - 1; choices held elsewhere (and empty rows, ids < 0) get group
    `local`, past the last group: sorted to the end, ragged_dot leaves them zero, and their gate is zero."""
    K, local = ids_mk.shape[-1], weights[0].shape[0]
    ids_mk = ids_mk - first
    mine_mk = (ids_mk >= 0) & (ids_mk < local)
    return grouped_experts(rows_mc[:, :-K], jnp.where(mine_mk, ids_mk, local), jnp.where(mine_mk, rows_mc[:, -K:], 0),
                           *weights)


def _static_exchange(x_nd, experts_nk, gates_nk, weights, axes, n: int, first) -> jax.Array:
    """Every token to every device of `axes` (n of them) and the results back, by static all-to-alls."""
    N, K = experts_nk.shape
    rows_jnc = jnp.broadcast_to(jnp.concatenate([x_nd, gates_nk.astype(x_nd.dtype)], -1), (n, N, x_nd.shape[-1] + K))
    ids_jnk = jnp.broadcast_to(experts_nk.astype(jnp.int32), (n, N, K))
    rows_jnc = jax.lax.all_to_all(rows_jnc, axes, 0, 0)  # now (source, N, .): what each source sent here
    ids_jnk = jax.lax.all_to_all(ids_jnk, axes, 0, 0)
    y_md = _local_experts(rows_jnc.reshape(n * N, -1), ids_jnk.reshape(n * N, K), weights, first)
    y_jnd = jax.lax.all_to_all(y_md.reshape(n, N, -1), axes, 0, 0)  # (destination, N, D), back home
    return jnp.sum(y_jnd, axis=0)


def _ragged_exchange(x_nd, experts_nk, gates_nk, weights, axes, first, to_jn, padded: bool) -> jax.Array:
    """Each token once to each device `to_jn` names (j, N) and the results back, by ragged all-to-alls.

    The send buffer is destination-major: the tokens bound for device j (at most N) are rows
    start_j .. start_j + send_j, in token order. On a receiver, source i's rows land at i N, so its
    buffers hold every source's every token (n N rows, the dropless worst case) and rows no source
    filled carry no expert (id -1)."""
    N, K = experts_nk.shape
    n = to_jn.shape[0]
    send_j = jnp.sum(to_jn, axis=1, dtype=jnp.int32)
    start_j = jnp.cumsum(send_j) - send_j
    row_jn = jnp.where(to_jn, start_j[:, None] + jnp.cumsum(to_jn, axis=1) - 1, n * N)
    token_r = jnp.full((n * N,), N, jnp.int32).at[row_jn.reshape(-1)].set(
        jnp.tile(jnp.arange(N, dtype=jnp.int32), n), mode="drop")  # the token of each send row; N: none
    rows_nc = jnp.concatenate([x_nd, gates_nk.astype(x_nd.dtype)], -1)
    rows_rc = jnp.take(rows_nc, token_r, axis=0, mode="fill", fill_value=0)
    ids_rk = jnp.take(experts_nk.astype(jnp.int32), token_r, axis=0, mode="fill", fill_value=-1)
    recv_i = jax.lax.all_to_all(send_j, axes, 0, 0, tiled=True)  # rows each source sends here
    slot_j = jnp.full((n,), jax.lax.axis_index(axes) * N, jnp.int32)  # where this device's rows go on each
    exchange = partial(ragged_all_to_all, axis_name=axes, max_send=N, padded=padded)
    got_mc = exchange(rows_rc, jnp.zeros_like(rows_rc), start_j, send_j, slot_j, recv_i)
    ids_mk = exchange(ids_rk, jnp.full_like(ids_rk, -1), start_j, send_j, slot_j, recv_i)
    y_md = _local_experts(got_mc, ids_mk, weights, first)
    home_i = jax.lax.all_to_all(start_j, axes, 0, 0, tiled=True)  # where source i's rows came from there
    back_rd = exchange(y_md, jnp.zeros_like(y_md), jnp.arange(n, dtype=jnp.int32) * N, recv_i, home_i, send_j)
    return jax.ops.segment_sum(back_rd, token_r, num_segments=N)  # row N (no token) is dropped


def dropless_experts(h_btd, gates_btk, experts_btk, p: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """The routed experts' output (B, T, D), no token dropped, each device on its own tokens, and the
    token rows sent to other devices of the expert axis (all devices; 0 without expert parallel)."""
    D, K = h_btd.shape[-1], experts_btk.shape[-1]
    weights = tuple(p[k].astype(dtype) for k in ("w_gate", "w_up", "w_down"))
    batch, length = _token_axes()
    experts = _expert_axes(batch + length) if batch or length else ()
    exchange = expert_exchange(active_layout().mesh.devices.flat[0].platform) if experts else "static"

    def local(h_btd, gates_btk, experts_btk, *w):
        b, t = h_btd.shape[:2]
        args = (h_btd.reshape(b * t, D), experts_btk.reshape(b * t, K), gates_btk.reshape(b * t, K), *w)
        if not experts:
            return grouped_experts(*args).reshape(b, t, D), jnp.zeros((), jnp.float32)
        out_nd, sent = expert_parallel_experts(*args, experts, exchange)
        return out_nd.reshape(b, t, D), jax.lax.psum(sent, batch + length)

    if not batch and not length:
        return local(h_btd, gates_btk, experts_btk, *weights)
    spec = P(batch or None, length or None)
    # A sort over tokens split across devices would gather them all (the partitioner cannot split a
    # sort), so each device sorts its own. Experts split over an axis that also splits the tokens
    # (`ep`) enter split, and tokens move to them by all-to-all; over any other axis they are gathered
    # at the boundary, their gradients reduced back: every device runs every expert on its own tokens.
    w_spec = P(experts) if experts else P()
    fn = jax.shard_map(local, mesh=active_layout().mesh, in_specs=(spec, spec, spec, w_spec, w_spec, w_spec),
                       out_specs=(spec, P()), axis_names=set(batch + length))
    return fn(h_btd, gates_btk, experts_btk, *weights)


def shared_experts(h_btd: jax.Array, p: dict, dtype) -> jax.Array:
    """The shared experts: one dense SwiGLU of n_shared_experts * mlp_dim that every token goes through."""
    gate_bts = jnp.einsum("btd,ds->bts", h_btd, p["shared_gate"].astype(dtype))
    up_bts = jnp.einsum("btd,ds->bts", h_btd, p["shared_up"].astype(dtype))
    hidden_bts = constrain(jax.nn.silu(gate_bts) * up_bts, (BATCH, LENGTH, MLP))
    return jnp.einsum("bts,sd->btd", hidden_bts, p["shared_down"].astype(dtype))


def capacity_experts(h_btd, probs_bte, gates_btk, experts_btk, p: dict, cfg: ModelConfig, dtype,
                     dropless: bool, choose_bte: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, dict]:
    """The routed experts' output with a capacity per expert and sequence, the balancing loss and the
    counts of `moe_block` (with the (token, choice) pairs dropped for want of a slot). `choose_bte`: what experts are chosen by, where
    it is not the probs (the scores plus the balancing bias)."""
    B, T, E = probs_bte.shape
    cap = T if dropless else cfg.expert_capacity(T)  # a dropped token keeps its residual
    # route() chooses as top_k does: by the probs, which order experts as the scores do
    dispatch_btec, combine_btec, aux, load_e = route(probs_bte, cfg.experts_per_token, cap, choose_bte, True)
    counts = {"load": load_e, "dropped": B * T * cfg.experts_per_token - jnp.sum(dispatch_btec),
              "sent": jnp.zeros((), jnp.float32)}
    if (cfg.router_scores, cfg.router_normalize, cfg.routed_scale) != ("softmax", True, 1.0):
        # route's gates are the chosen probs renormalised; top_k_gates gives the others
        gates_bte = jnp.einsum("btke,btk->bte", jax.nn.one_hot(experts_btk, E, dtype=jnp.float32), gates_btk)
        combine_btec = dispatch_btec * gates_bte[..., None]
    # The all-to-all: rows split over (data, expert) become experts split over expert.
    x_ebcd = jnp.einsum("btd,btec->ebcd", h_btd, dispatch_btec.astype(dtype))
    x_ebcd = constrain(x_ebcd, (None, BATCH, None, EMBED))  # dispatched where the rows are
    x_ebcd = constrain(x_ebcd, (EXPERT, EXPERT_BATCH, None, EMBED))
    gate_ebcf = jnp.einsum("ebcd,edf->ebcf", x_ebcd, p["w_gate"].astype(dtype))
    up_ebcf = jnp.einsum("ebcd,edf->ebcf", x_ebcd, p["w_up"].astype(dtype))
    hidden_ebcf = constrain(jax.nn.silu(gate_ebcf) * up_ebcf, (EXPERT, EXPERT_BATCH, None, MLP))
    y_ebcd = jnp.einsum("ebcf,efd->ebcd", hidden_ebcf, p["w_down"].astype(dtype))
    y_ebcd = constrain(y_ebcd, (EXPERT, EXPERT_BATCH, None, EMBED))
    y_ebcd = constrain(y_ebcd, (None, BATCH, None, EMBED))  # back where the rows are
    return jnp.einsum("ebcd,btec->btd", y_ebcd, combine_btec.astype(dtype)), aux, counts  # and back


def moe_block(h_btd: jax.Array, p: dict, cfg: ModelConfig, dtype, dropless: bool = False,
              bias_e: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """The MoE feed-forward of one layer on the normalised residual; returns its output, aux loss and
    counts: {"load": (E,) (token, choice) pairs routed to each expert, "dropped": those a capacity
    dropped, "sent": the token rows dropless routing sent to other devices of the expert axis (what a
    ragged all-to-all moves each way), "z": the router z-loss}. `bias_e` (E,): the balancing bias experts are chosen by (`top_k_gates`).
    `dropless` with capacity routing: each expert has a slot for every token of the group (a token picks
    an expert once), so none is dropped, whatever the length: generation's prefill and decode steps then
    compute the same. Dropless routing (model.moe_routing) never drops one."""
    logits_bte = router_logits(h_btd, p["router"])
    scores_bte, probs_bte = router_scores(logits_bte, cfg)
    gates_btk, experts_btk = top_k_gates(scores_bte, cfg, bias_e)
    if cfg.moe_routing == "dropless":
        out_btd, sent = dropless_experts(h_btd, gates_btk, experts_btk, p, dtype)
        aux = balance_loss(experts_btk, probs_bte)
        counts = {"load": expert_load(experts_btk, cfg.n_experts), "dropped": jnp.zeros((), jnp.float32),
                  "sent": sent}
    else:
        choose_bte = None if bias_e is None else scores_bte + bias_e
        out_btd, aux, counts = capacity_experts(h_btd, probs_bte, gates_btk, experts_btk, p, cfg, dtype,
                                                dropless, choose_bte)
    if cfg.n_shared_experts:
        out_btd = out_btd + shared_experts(h_btd, p, dtype)
    counts["z"] = z_loss(logits_bte)
    return constrain(out_btd, (BATCH, RES_LENGTH, EMBED)), aux, counts
