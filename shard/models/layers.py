"""The decoder layer's sublayers (shard.models.llama): the RMSNorm, RoPE, the attention block (q, k, v
projections, RoPE, the KV cache's writes, then shard.models.attention) and the gated MLP (SwiGLU or
GeGLU), each a pure function of one layer's parameter dict; LoRA adapters add their terms here.

Dimension letters as in shard.models.llama: B batch, T length, D embed, N heads, K kv_heads, G = N/K
query heads per kv head, H head_dim, F mlp.
"""

import functools

import jax
import jax.numpy as jnp

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LENGTH, MLP
from shard.config.model import ModelConfig
from shard.models import lora as adapters
from shard.config.precision import BF16
from shard.models.fp8 import fusable, matmul
from shard.models.attention import (cached_attention, causal_attention, max_logits, rolling_attention,
                                    rolling_cache)
from shard.sharding.queries import heads_split_alike
from shard.sharding.rules import constrain


def norm(cfg: ModelConfig, x, scale):
    """The model's RMSNorm: scaled by `scale`, or by (1 + scale) with cfg.norm_plus_one (Gemma)."""
    return rms_norm(x, scale, cfg.norm_eps, 1.0 if cfg.norm_plus_one else 0.0)


def rms_norm(x, scale, eps: float, offset: float = 0.0):
    """In float32, scaled by (offset + scale). Below float32 (bf16 compute) it is recomputed in the
    backward pass: otherwise its float32 copies of x were saved whatever the remat policy, two per norm
    under remat none. In float32 there are no copies to spare, and on XLA:CPU the recomputation cost 20%
    of the tiny model's step."""
    if x.dtype == jnp.float32:
        return _rms_norm(x, scale, eps, offset)
    return _rms_norm_recomputed(x, scale, eps, offset)


def _rms_norm(x, scale, eps: float, offset: float = 0.0):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (offset + scale.astype(jnp.float32))).astype(x.dtype)


_rms_norm_recomputed = jax.checkpoint(_rms_norm, static_argnums=(2, 3), prevent_cse=False)


def rope_tables(positions_t: jax.Array, cfg: ModelConfig, local: bool = False):
    """cos/sin of shape (T, H) at these positions, in the rotate-half layout used by Llama checkpoints;
    (B, T, H) for per-row positions (B, T) (packed rows). `local`: the windowed layers' (rope_local_theta).
    Both times YaRN's attention factor where the RoPE is YaRN's, as transformers applies it."""
    inv_freq = jnp.asarray(cfg.rope_frequencies(local))
    if positions_t.ndim == 2:
        angles = positions_t.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # (B, T, H/2)
    else:
        angles = positions_t.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = cfg.rope_attention_scale(local)  # YaRN's attention factor; 1 otherwise
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x_btnh, cos_th, sin_th):
    """x rotated by the tables of `rope_tables`: (T, H), or (B, T, H) per row."""
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    if cos_th.ndim == 3:
        out = x_btnh.astype(jnp.float32) * cos_th[:, :, None, :] + rotated * sin_th[:, :, None, :]
    else:
        out = x_btnh.astype(jnp.float32) * cos_th[:, None, :] + rotated * sin_th[:, None, :]
    return out.astype(x_btnh.dtype)


def attention_block(x_btd, p, cos_th, sin_th, cfg: ModelConfig, dtype, kv=None, start=0, zigzag: bool = False,
                    segment_ids=None, window=None, record: dict | None = None, recipes: dict | None = None,
                    histories: dict | None = None, gathers: dict | None = None):
    """Pre-norm attention; returns (output, kv). With a cache slice `kv` ({k, v}: (B, S, K, H)) the new
    keys and values are written at `start` and the queries attend to the whole cache, masked by position.
    `zigzag`, `segment_ids`: as in `forward`. `window`: this layer's (0: none; traced where layers
    differ, cfg.global_every); None: cfg.sliding_window. `record` (training with optimizer.qk_clip): a
    dict the block puts each head's largest attention logit in, "max_logit" (N,) (`max_logits`).
    `recipes`: the FP8 recipe of each weight that has one (shard.models.fp8.stack_recipes); `histories`:
    the amax histories of this layer's fp8_delayed weights, by weight; `gathers`: the logical axes of the
    weights that arrive as stored, to be quantized before their gather (shard.models.fp8.gathered)."""
    recipes, histories, gathers = recipes or {}, histories or {}, gathers or {}
    window = cfg.sliding_window if window is None else window
    scale = cfg.attention_scale
    # Megatron-SP: the residual stream's length shards are gathered here, once, for the matmuls (left
    # free, XLA gathered the weights instead and moved q, k, v all-to-all); a no-op without SP.
    h_btd = constrain(norm(cfg, x_btd, p["attn_norm"]), (BATCH, LENGTH, EMBED))
    q_btnh, k_btkh, v_btkh = _qkv(h_btd, p, dtype, recipes, histories, gathers)
    if cfg.qk_norm:  # Qwen3: each head's query and key normalised over head_dim, before RoPE
        q_btnh, k_btkh = norm(cfg, q_btnh, p["q_norm"]), norm(cfg, k_btkh, p["k_norm"])
    q_btnh = constrain(apply_rope(q_btnh, cos_th, sin_th), (BATCH, LENGTH, HEADS, HEAD_DIM))
    k_btkh = constrain(apply_rope(k_btkh, cos_th, sin_th), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v_btkh = constrain(v_btkh, (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    if record is not None:
        record["max_logit"] = max_logits(q_btnh, k_btkh, scale, window, segment_ids, cfg.attention_chunk)
    if kv is None:
        o_btnh = causal_attention(q_btnh, k_btkh, v_btkh, cfg.attention, zigzag, segment_ids, window, scale,
                                  cfg.attn_softcap, cfg.attention_chunk)
    elif rolling_cache(kv, window):
        o_btnh, kv = rolling_attention(q_btnh, k_btkh, v_btkh, kv, start, window, scale, cfg.attn_softcap)
    else:
        kv = {"k": jax.lax.dynamic_update_slice_in_dim(kv["k"], k_btkh.astype(kv["k"].dtype), start, axis=1),
              "v": jax.lax.dynamic_update_slice_in_dim(kv["v"], v_btkh.astype(kv["v"].dtype), start, axis=1)}
        o_btnh = cached_attention(q_btnh, kv["k"], kv["v"], start, window=window, scale=scale,
                                  softcap=cfg.attn_softcap)
    o_btnh = constrain(o_btnh, (BATCH, LENGTH, HEADS, HEAD_DIM))
    out_btd = matmul("btnh,nhd->btd", o_btnh, p["wo"].astype(dtype), recipes.get("wo", BF16), histories.get("wo"),
                     gathers.get("wo"))
    return adapters.with_delta(out_btd, o_btnh, p, "wo", p.get("dropout_key")), kv


def _qkv(h_btd, p, dtype, recipes, histories, gathers):
    """q, k and v of the normalised residual.

    Where heads and kv heads are split alike, they come out of one einsum over a weight grouped by kv
    head, (D, K, G + 2, H): with heads split for tensor parallel, the backward pass then all-reduces
    one input gradient, not three. The grouping is local to each device and leaves the parameters as
    they are. Where kv heads are split otherwise (replicated by `rules.kv_heads=none` while heads are
    split), grouping would move weights between devices (collective permutes, which deadlock inside
    the 1F1B pipeline's per-stage branches), so three einsums run instead. The biases of qkv_bias
    (`bq`, `bk`, `bv`) are grouped as their weights are. LoRA adapters add their terms to q, k and v.
    In FP8 the grouped weight is quantized as one (one tensorwise scale for the three) where the three
    share a recipe; three einsums run where their recipes differ or are fp8_delayed (a history each).
    Weights that arrive as stored (`gathers`) are grouped as stored, then quantized and gathered as one.
    """
    q_btnh, k_btkh, v_btkh = _qkv_base(h_btd, p, dtype, recipes, histories, gathers)
    key = p.get("dropout_key")
    return tuple(adapters.with_delta(y, h_btd, p, name, key)
                 for y, name in ((q_btnh, "wq"), (k_btkh, "wk"), (v_btkh, "wv")))


def _qkv_base(h_btd, p, dtype, recipes, histories, gathers):
    D, N, H = p["wq"].shape
    K = p["wk"].shape[1]
    rq, rk, rv = (recipes.get(name, BF16) for name in ("wq", "wk", "wv"))
    if not heads_split_alike() or not fusable(rq, rk, rv):
        q_btnh, k_btkh, v_btkh = (matmul(subscripts, h_btd, p[name].astype(dtype), r, histories.get(name), gathers.get(name))
                                  for subscripts, name, r in (("btd,dnh->btnh", "wq", rq), ("btd,dkh->btkh", "wk", rk),
                                                              ("btd,dkh->btkh", "wv", rv)))
        if "bq" in p:
            q_btnh, k_btkh, v_btkh = (q_btnh + p["bq"].astype(dtype), k_btkh + p["bk"].astype(dtype),
                                      v_btkh + p["bv"].astype(dtype))
        return q_btnh, k_btkh, v_btkh
    w_dkgh = jnp.concatenate([p["wq"].reshape(D, K, N // K, H), p["wk"][:, :, None], p["wv"][:, :, None]], 2)
    gather = (*gathers["wk"][:2], None, gathers["wk"][2]) if "wk" in gathers else None  # (D, K, G + 2, H)
    qkv_btkgh = matmul("btd,dkgh->btkgh", h_btd, w_dkgh.astype(dtype), rq, gather=gather)
    if "bq" in p:
        b_kgh = jnp.concatenate([p["bq"].reshape(K, N // K, H), p["bk"][:, None], p["bv"][:, None]], 1)
        qkv_btkgh = qkv_btkgh + b_kgh.astype(dtype)
    B, T = qkv_btkgh.shape[:2]
    return qkv_btkgh[:, :, :, : N // K].reshape(B, T, N, H), qkv_btkgh[:, :, :, -2], qkv_btkgh[:, :, :, -1]


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(2,))
def _gated(gate, up, activation: str = "silu"):
    """act(gate) * up (SwiGLU, or GeGLU with tanh-approximate GELU), recomputed in the backward pass from
    gate and up: autodiff saved four more (B, T, mlp) tensors (the sigmoid, the silu, ...) under remat
    none."""
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return act * up


def mlp_block(x_btd, p, cfg: ModelConfig, dtype, recipes: dict | None = None, histories: dict | None = None,
              gathers: dict | None = None):
    """Pre-norm gated MLP; `recipes`, `histories`, `gathers` as in `attention_block`."""
    recipes, histories, gathers = recipes or {}, histories or {}, gathers or {}
    h_btd = constrain(norm(cfg, x_btd, p["mlp_norm"]), (BATCH, LENGTH, EMBED))  # as in attention
    # Gate and up in one einsum, for the same reason as q, k, v: one input-gradient all-reduce (two
    # where their FP8 recipes differ).
    r_gate, r_up = recipes.get("w_gate", BF16), recipes.get("w_up", BF16)
    if fusable(r_gate, r_up):
        w_dsf = jnp.stack([p["w_gate"], p["w_up"]], axis=1)
        gather = (gathers["w_gate"][0], None, gathers["w_gate"][1]) if "w_gate" in gathers else None  # (D, 2, F)
        gate_up_btsf = matmul("btd,dsf->btsf", h_btd, w_dsf.astype(dtype), r_gate, gather=gather)
    else:
        gate_up_btsf = jnp.stack([matmul("btd,df->btf", h_btd, p[name].astype(dtype), r, histories.get(name),
                                         gathers.get(name))
                                  for name, r in (("w_gate", r_gate), ("w_up", r_up))], axis=2)
    key = p.get("dropout_key")  # LoRA
    gate_btf = adapters.with_delta(gate_up_btsf[:, :, 0], h_btd, p, "w_gate", key)
    up_btf = adapters.with_delta(gate_up_btsf[:, :, 1], h_btd, p, "w_up", key)
    hidden_btf = constrain(_gated(gate_btf, up_btf, cfg.mlp_activation), (BATCH, LENGTH, MLP))
    down_btd = matmul("btf,fd->btd", hidden_btf, p["w_down"].astype(dtype), recipes.get("w_down", BF16),
                      histories.get("w_down"), gathers.get("w_down"))
    return adapters.with_delta(down_btd, hidden_btf, p, "w_down", key)
