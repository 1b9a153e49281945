"""Mixture-of-experts feed-forward layer: top-k routing with a capacity, a load-balancing auxiliary
loss, and SwiGLU experts (GShard / Switch Transformer).

Each sequence is a routing group. Tokens are dispatched into a (experts, batch, capacity, embed)
tensor whose expert dim is pinned to the `expert` logical axis and whose batch dim to `expert_batch`;
when a preset maps `expert` to a mesh axis that also splits the batch, XLA moves tokens between the
two layouts with an all-to-all. Mesh axes never appear here.

Letters: B batch, T length (tokens per group), D embed, E experts, C capacity, F mlp.
"""

import jax
import jax.numpy as jnp

from shard.axes import BATCH, EMBED, EXPERT, EXPERT_BATCH, LAYERS, MLP, RES_LENGTH
from shard.config.model import ModelConfig
from shard.sharding.rules import constrain


# The logical axes of one layer's router and experts (the stacked parameters less LAYERS)
EXPERT_AXES = {"router": (EMBED, None), "w_gate": (EXPERT, EMBED, MLP), "w_up": (EXPERT, EMBED, MLP),
               "w_down": (EXPERT, MLP, EMBED)}


def expert_params(rngs, cfg: ModelConfig, out_std: float, param) -> dict:
    """Router and stacked expert weights for every layer, with their logical axes."""
    D, L, E, F = cfg.d_model, cfg.n_layers, cfg.n_experts, cfg.mlp_dim
    dt = jnp.dtype(cfg.param_dtype)
    return dict(
        router=param(rngs, (L, D, E), (LAYERS, *EXPERT_AXES["router"]), D**-0.5, dt),
        w_gate=param(rngs, (L, E, D, F), (LAYERS, *EXPERT_AXES["w_gate"]), D**-0.5, dt),
        w_up=param(rngs, (L, E, D, F), (LAYERS, *EXPERT_AXES["w_up"]), D**-0.5, dt),
        w_down=param(rngs, (L, E, F, D), (LAYERS, *EXPERT_AXES["w_down"]), F**-0.5 * out_std, dt),
    )


def route(probs_bte: jax.Array, k: int, cap: int):
    """Top-k routing with a capacity per expert and group.

    Returns dispatch_btec (0/1: token t goes to slot c of expert e), combine_btec (the same, weighted by
    the token's renormalised gate) and the Switch load-balancing loss E * sum_e f_e * P_e (f_e: share
    of first choices going to e, P_e: mean router probability of e), which is 1 when balanced.
    Earlier choices take slots first, then earlier tokens.
    """
    B, T, E = probs_bte.shape
    remaining_bte = probs_bte
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
    return dispatch_btec, combine_btec, aux


def router_probs(h_btd: jax.Array, router_de: jax.Array) -> jax.Array:
    logits_bte = jnp.einsum("btd,de->bte", h_btd.astype(jnp.float32), router_de.astype(jnp.float32))
    return jax.nn.softmax(logits_bte, axis=-1)


def moe_block(h_btd: jax.Array, p: dict, cfg: ModelConfig, dtype, dropless: bool = False
              ) -> tuple[jax.Array, jax.Array]:
    """The MoE feed-forward of one layer on the normalised residual; returns its output and aux loss.
    `dropless`: each expert has a slot for every token of the group (a token picks an expert once), so
    none is dropped, whatever the length: generation's prefill and decode steps then compute the same."""
    T = h_btd.shape[1]
    cap = T if dropless else cfg.expert_capacity(T)  # a dropped token keeps its residual
    dispatch_btec, combine_btec, aux = route(router_probs(h_btd, p["router"]), cfg.experts_per_token, cap)
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
    out_btd = jnp.einsum("ebcd,btec->btd", y_ebcd, combine_btec.astype(dtype))  # and back
    return constrain(out_btd, (BATCH, RES_LENGTH, EMBED)), aux
