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
two layouts with an all-to-all.

Dropless routing runs per device: each device sorts its own tokens and multiplies them by every expert
(`grouped_experts`); under expert parallel (`ep`: the expert axis also splits the tokens) the experts
stay split and each token goes to the devices holding its experts and back, by a ragged all-to-all.
The top-k choice of experts runs per device too. That is hand-written SPMD code, shard_maps over the
mesh axes that split the tokens: shard.parallel.expert_exchange's (`dropless_per_device`,
`per_device_top_k`). Mesh axes never appear here. The layer's parameters are
shard.config.params.expert_params'.

Letters: B batch, T length (tokens per group), D embed, E experts, C capacity, F mlp, K experts per
token, N tokens, M = N K (token, choice) pairs, S shared experts' hidden width.
"""

import functools

import jax
import jax.numpy as jnp

from shard.axes import BATCH, EMBED, EXPERT, EXPERT_BATCH, LENGTH, MLP, RES_LENGTH
from shard.config.model import ModelConfig
from shard.config.precision import BF16
from shard.models import matmuls
from shard.models.fp8 import matmul, ragged_matmul
from shard.parallel.expert_exchange import dropless_per_device, per_device_top_k
from shard.sharding.queries import token_axes
from shard.sharding.rules import constrain


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
    highest scores + bias, and their gates the scores alone; with group-limited routing
    (cfg.router_groups), among the experts of the token's best groups only (`choice_scores`)."""
    choose_bte = choice_scores(scores_bte, cfg, bias_e)
    if choose_bte is None:
        gates_btk, experts_btk = per_device_top_k(scores_bte, cfg.experts_per_token)
    else:
        _, experts_btk = per_device_top_k(choose_bte, cfg.experts_per_token)
        gates_btk = jnp.take_along_axis(scores_bte, experts_btk, axis=-1)
    if cfg.router_normalize:
        gates_btk = gates_btk / jnp.maximum(jnp.sum(gates_btk, axis=-1, keepdims=True), 1e-9)
    return gates_btk * cfg.routed_scale, experts_btk


def choice_scores(scores_bte: jax.Array, cfg: ModelConfig, bias_e: jax.Array | None = None) -> jax.Array | None:
    """What experts are chosen by where it is not the scores themselves (None there): the scores plus
    the balancing bias, and with group-limited routing (DeepSeek-V3's n_group, topk_group) those of
    experts outside the token's router_topk_groups best groups at -inf. A group scores the sum of its
    two best (biased) scores."""
    if bias_e is None and cfg.router_groups == 1:
        return None
    choose_bte = scores_bte if bias_e is None else scores_bte + bias_e
    if cfg.router_groups == 1:
        return choose_bte
    B, T, E = choose_bte.shape
    G = cfg.router_groups
    choose_btgx = choose_bte.reshape(B, T, G, E // G)
    best2_btg2, _ = per_device_top_k(choose_btgx, 2)
    _, groups_btk = per_device_top_k(jnp.sum(best2_btg2, axis=-1), cfg.router_topk_groups)
    kept_btg = jnp.any(groups_btk[..., None] == jnp.arange(G, dtype=groups_btk.dtype), axis=-2)
    return jnp.where(kept_btg[..., None], choose_btgx, -jnp.inf).reshape(B, T, E)


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
                    w_up_edf: jax.Array, w_down_efd: jax.Array, recipes: dict | None = None,
                    axes: tuple[str, ...] = ()) -> jax.Array:
    """Dropless: each token's sum over its k choices of gate * expert(token), by grouped matmuls.

    The N K (token, choice) pairs are sorted by expert (stably), so each expert's rows form one
    contiguous group of `ragged_dot`; the results return to their pairs by the inverse permutation.
    `recipes`: the FP8 recipe of the expert stacks that have one (shard.models.fp8.ragged_matmul), their
    amaxes taken over the manual mesh `axes` the tokens are split over."""
    recipes = recipes or {}
    N, K = experts_nk.shape
    E = w_gate_edf.shape[0]
    expert_m = experts_nk.reshape(N * K)
    order_m = jnp.argsort(expert_m, stable=True)  # sorted row i is pair order_m[i]
    sizes_e = jnp.bincount(expert_m, length=E).astype(jnp.int32)  # rows of each expert's group
    x_md = x_nd[order_m // K]  # (M, D) tokens in expert order
    gate_mf = ragged_matmul(x_md, w_gate_edf, sizes_e, recipes.get("w_gate", BF16), axes)
    up_mf = ragged_matmul(x_md, w_up_edf, sizes_e, recipes.get("w_up", BF16), axes)
    y_md = ragged_matmul(jax.nn.silu(gate_mf) * up_mf, w_down_efd, sizes_e, recipes.get("w_down", BF16), axes)
    y_nkd = y_md[jnp.argsort(order_m)].reshape(N, K, -1)  # back in (token, choice) order
    return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y_nkd.dtype))


def dropless_experts(h_btd, gates_btk, experts_btk, p: dict, dtype, recipes: dict | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """The routed experts' output (B, T, D), no token dropped, each device on its own tokens, and the
    token rows sent to other devices of the expert axis (all devices; 0 without expert parallel):
    `grouped_experts` per device (shard.parallel.expert_exchange.dropless_per_device)."""
    weights = tuple(p[k].astype(dtype) for k in ("w_gate", "w_up", "w_down"))
    experts = {k: r for k, r in (recipes or {}).items() if k in ("w_gate", "w_up", "w_down")}
    run = grouped_experts
    if experts:  # the shard_map's manual axes, over which FP8 amaxes are reduced
        run = functools.partial(grouped_experts, recipes=experts, axes=sum(token_axes(), ()))
    return dropless_per_device(h_btd, gates_btk, experts_btk, weights, run)


def shared_experts(h_btd: jax.Array, p: dict, dtype) -> jax.Array:
    """The shared experts: one dense SwiGLU of n_shared_experts * mlp_dim that every token goes through."""
    gate_bts = matmuls.einsum("btd,ds->bts", h_btd, p["shared_gate"].astype(dtype))
    up_bts = matmuls.einsum("btd,ds->bts", h_btd, p["shared_up"].astype(dtype))
    hidden_bts = constrain(jax.nn.silu(gate_bts) * up_bts, (BATCH, LENGTH, MLP))
    return matmuls.einsum("bts,sd->btd", hidden_bts, p["shared_down"].astype(dtype))


def capacity_experts(h_btd, probs_bte, gates_btk, experts_btk, p: dict, cfg: ModelConfig, dtype,
                     dropless: bool, choose_bte: jax.Array | None = None, recipes: dict | None = None
                     ) -> tuple[jax.Array, jax.Array, dict]:
    """The routed experts' output with a capacity per expert and sequence, the balancing loss and the
    counts of `moe_block` (with the (token, choice) pairs dropped for want of a slot). `choose_bte`: what experts are chosen by, where
    it is not the probs (the scores plus the balancing bias). `recipes`: as in `moe_block`."""
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
    recipes = recipes or {}
    gate_ebcf = matmul("ebcd,edf->ebcf", x_ebcd, p["w_gate"].astype(dtype), recipes.get("w_gate", BF16))
    up_ebcf = matmul("ebcd,edf->ebcf", x_ebcd, p["w_up"].astype(dtype), recipes.get("w_up", BF16))
    hidden_ebcf = constrain(jax.nn.silu(gate_ebcf) * up_ebcf, (EXPERT, EXPERT_BATCH, None, MLP))
    y_ebcd = matmul("ebcf,efd->ebcd", hidden_ebcf, p["w_down"].astype(dtype), recipes.get("w_down", BF16))
    y_ebcd = constrain(y_ebcd, (EXPERT, EXPERT_BATCH, None, EMBED))
    y_ebcd = constrain(y_ebcd, (None, BATCH, None, EMBED))  # back where the rows are
    return jnp.einsum("ebcd,btec->btd", y_ebcd, combine_btec.astype(dtype)), aux, counts  # and back


def moe_block(h_btd: jax.Array, p: dict, cfg: ModelConfig, dtype, dropless: bool = False,
              bias_e: jax.Array | None = None, recipes: dict | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """The MoE feed-forward of one layer on the normalised residual; returns its output, aux loss and
    counts: {"load": (E,) (token, choice) pairs routed to each expert, "dropped": those a capacity
    dropped, "sent": the token rows dropless routing sent to other devices of the expert axis (what a
    ragged all-to-all moves each way), "z": the router z-loss}. `bias_e` (E,): the balancing bias experts are chosen by (`top_k_gates`).
    `dropless` with capacity routing: each expert has a slot for every token of the group (a token picks
    an expert once), so none is dropped, whatever the length: generation's prefill and decode steps then
    compute the same. Dropless routing (model.moe_routing) never drops one. `recipes`: the FP8 recipe of
    the expert stacks the precision rules name (fp8_tensorwise; shard.models.fp8.stack_recipes)."""
    logits_bte = router_logits(h_btd, p["router"])
    scores_bte, probs_bte = router_scores(logits_bte, cfg)
    gates_btk, experts_btk = top_k_gates(scores_bte, cfg, bias_e)
    if cfg.moe_routing == "dropless":
        out_btd, sent = dropless_experts(h_btd, gates_btk, experts_btk, p, dtype, recipes)
        aux = balance_loss(experts_btk, probs_bte)
        counts = {"load": expert_load(experts_btk, cfg.n_experts), "dropped": jnp.zeros((), jnp.float32),
                  "sent": sent}
    else:
        choose_bte = choice_scores(scores_bte, cfg, bias_e)
        out_btd, aux, counts = capacity_experts(h_btd, probs_bte, gates_btk, experts_btk, p, cfg, dtype,
                                                dropless, choose_bte, recipes)
    if cfg.n_shared_experts:
        out_btd = out_btd + shared_experts(h_btd, p, dtype)
    counts["z"] = z_loss(logits_bte)
    return constrain(out_btd, (BATCH, RES_LENGTH, EMBED)), aux, counts
