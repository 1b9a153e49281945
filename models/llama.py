"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, grouped-query attention.

The layers are stored stacked (a leading `layers` dim) and run with `lax.scan`, so compile time does
not grow with depth. Every parameter names its logical axes; key activations are pinned with
`constrain`. Mesh axes never appear here.

Dimension letters (see shard.axes): B batch, T length, D embed, N heads, K kv_heads, G = N/K query
heads per kv head, H head_dim, F mlp, V vocab, L layers.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LAYERS, LENGTH, MLP, VOCAB
from shard.models.configs import ModelConfig
from shard.rules import constrain

# Logical axes of each per-layer weight (stored with a leading LAYERS dim). Inside the scanned block
# every weight is pinned to these axes under the activation rules: the layout it is computed in. For
# FSDP that is where the weight is gathered (once per use), instead of leaving XLA free to move
# activations to the sharded weight. Weights are cast to the compute dtype first, so FSDP gathers
# (and reduce-scatters gradients) in bf16 on accelerators.
LAYER_AXES = {
    "attn_norm": (EMBED,),
    "wq": (EMBED, HEADS, HEAD_DIM),
    "wk": (EMBED, KV_HEADS, HEAD_DIM),
    "wv": (EMBED, KV_HEADS, HEAD_DIM),
    "wo": (HEADS, HEAD_DIM, EMBED),
    "mlp_norm": (EMBED,),
    "w_gate": (EMBED, MLP),
    "w_up": (EMBED, MLP),
    "w_down": (MLP, EMBED),
}

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def compute_dtype(cfg: ModelConfig):
    if cfg.compute_dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(cfg.compute_dtype)


def _param(rngs: nnx.Rngs, shape, axes, std: float | None, dtype) -> nnx.Param:
    """A parameter with its logical axes; std=None means ones (norm scales)."""
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.truncated_normal(rngs.params(), -3.0, 3.0, shape)).astype(dtype)
    return nnx.Param(value, out_sharding=axes)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, L, N, K, H, F, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                               cfg.mlp_dim, cfg.vocab_size)
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 1.0 / (2 * L) ** 0.5  # residual branches scaled down with depth (GPT-2)
        self.embed = _param(rngs, (V, D), (VOCAB, EMBED), D**-0.5, dt)  # table_vd; tied: logits std ~1
        std = {"attn_norm": None, "wq": D**-0.5, "wk": D**-0.5, "wv": D**-0.5,
               "wo": (N * H) ** -0.5 * out_std, "mlp_norm": None, "w_gate": D**-0.5, "w_up": D**-0.5,
               "w_down": F**-0.5 * out_std}
        shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, K, H), "wv": (D, K, H), "wo": (N, H, D),
                  "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
        self.layers = nnx.Dict({name: _param(rngs, (L, *shapes[name]), (LAYERS, *axes), std[name], dt)
                                for name, axes in LAYER_AXES.items()})
        self.final_norm = _param(rngs, (D,), (EMBED,), None, dt)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (D, V), (EMBED, VOCAB), D**-0.5, dt)  # w_dv

    def __call__(self, tokens_bt: jax.Array, cache: dict | None = None, start=0):
        """Next-token logits (float32) for a batch of token ids.

        With a KV cache (`init_cache`), the tokens sit at positions start.. and attend to everything
        cached before them; returns (logits, updated cache). This is the prefill and decode path of
        `shard generate`; training calls it without a cache.
        """
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        T = tokens_bt.shape[1]
        # The table in its compute layout and dtype (FSDP: gathered once, in the compute dtype, and
        # shared by the lookup and the tied logits).
        table_vd = constrain(self.embed[...].astype(dtype), (VOCAB, EMBED))
        x_btd = jnp.take(table_vd, tokens_bt, axis=0)
        x_btd = constrain(x_btd, (BATCH, LENGTH, EMBED))
        cos_th, sin_th = rope_tables(start + jnp.arange(T), cfg.head_dim, cfg.rope_theta)
        layers = {k: v[...] for k, v in self.layers.items()}

        def block(x_btd, xs):
            p, kv = xs
            p = {k: constrain(v if k.endswith("norm") else v.astype(dtype), LAYER_AXES[k])
                 for k, v in p.items()}
            attn_btd, kv = attention_block(x_btd, p, cos_th, sin_th, cfg, dtype, kv, start)
            x_btd = x_btd + attn_btd
            x_btd = x_btd + mlp_block(x_btd, p, cfg, dtype)
            return constrain(x_btd, (BATCH, LENGTH, EMBED)), kv

        if cfg.remat != "none":
            block = jax.checkpoint(block, policy=_REMAT[cfg.remat], prevent_cse=False)
        x_btd, new_cache = jax.lax.scan(block, x_btd, (layers, cache))
        x_btd = rms_norm(x_btd, self.final_norm[...], cfg.norm_eps)
        if cfg.tie_embeddings:
            logits_btv = jnp.einsum("btd,vd->btv", x_btd, table_vd)
        else:
            w_dv = constrain(self.unembed[...].astype(dtype), (EMBED, VOCAB))
            logits_btv = jnp.einsum("btd,dv->btv", x_btd, w_dv)
        logits_btv = constrain(logits_btv.astype(jnp.float32), (BATCH, LENGTH, VOCAB))
        return logits_btv if cache is None else (logits_btv, new_cache)


CACHE_AXES = (LAYERS, BATCH, LENGTH, KV_HEADS, HEAD_DIM)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache: k and v of shape (L, B, max_len, K, H) in the compute dtype."""
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, compute_dtype(cfg)), "v": jnp.zeros(shape, compute_dtype(cfg))}


def rms_norm(x, scale, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions_t: jax.Array, head_dim: int, theta: float):
    """cos/sin of shape (T, H) at these positions, in the rotate-half layout used by Llama checkpoints."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles_th = positions_t.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles_th = jnp.concatenate([angles_th, angles_th], axis=-1)
    return jnp.cos(angles_th), jnp.sin(angles_th)


def apply_rope(x_btnh, cos_th, sin_th):
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_btnh.astype(jnp.float32) * cos_th[:, None, :] + rotated * sin_th[:, None, :]
    return out.astype(x_btnh.dtype)


def attention_block(x_btd, p, cos_th, sin_th, cfg: ModelConfig, dtype, kv=None, start=0):
    """Pre-norm attention; returns (output, kv). With a cache slice `kv` ({k, v}: (B, S, K, H)) the new
    keys and values are written at `start` and the queries attend to the whole cache, masked by position."""
    h_btd = rms_norm(x_btd, p["attn_norm"], cfg.norm_eps)
    # q, k and v come out of one einsum over a weight grouped by kv head, (D, K, G + 2, H): with heads
    # split for tensor parallel, the backward pass then all-reduces one input gradient, not three.
    # The grouping is local to each device (model divides K) and leaves the parameters as they are.
    D, N, H = p["wq"].shape
    K = p["wk"].shape[1]
    w_dkgh = jnp.concatenate([p["wq"].reshape(D, K, N // K, H), p["wk"][:, :, None], p["wv"][:, :, None]], 2)
    qkv_btkgh = jnp.einsum("btd,dkgh->btkgh", h_btd, w_dkgh.astype(dtype))
    B, T = qkv_btkgh.shape[:2]
    q_btnh = qkv_btkgh[:, :, :, : N // K].reshape(B, T, N, H)
    k_btkh, v_btkh = qkv_btkgh[:, :, :, -2], qkv_btkgh[:, :, :, -1]
    q_btnh = constrain(apply_rope(q_btnh, cos_th, sin_th), (BATCH, LENGTH, HEADS, HEAD_DIM))
    k_btkh = constrain(apply_rope(k_btkh, cos_th, sin_th), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v_btkh = constrain(v_btkh, (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    if kv is None:
        o_btnh = causal_attention(q_btnh, k_btkh, v_btkh, cfg.attention)
    else:
        kv = {"k": jax.lax.dynamic_update_slice_in_dim(kv["k"], k_btkh.astype(kv["k"].dtype), start, axis=1),
              "v": jax.lax.dynamic_update_slice_in_dim(kv["v"], v_btkh.astype(kv["v"].dtype), start, axis=1)}
        o_btnh = cached_attention(q_btnh, kv["k"], kv["v"], start)
    o_btnh = constrain(o_btnh, (BATCH, LENGTH, HEADS, HEAD_DIM))
    return jnp.einsum("btnh,nhd->btd", o_btnh, p["wo"].astype(dtype)), kv


def causal_attention(q_btnh, k_bskh, v_bskh, impl: str):
    """Causal grouped-query attention; "xla" goes through jax.nn.dot_product_attention (cuDNN flash
    attention on GPU when it applies), "reference" is the plain einsum version used to check it."""
    if impl == "xla":
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True)
    return cached_attention(q_btnh, k_bskh, v_bskh, 0)


def cached_attention(q_btnh, k_bskh, v_bskh, start):
    """Grouped-query attention of queries at positions start.. over keys at positions 0..S-1, causal."""
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H)
    scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh).astype(jnp.float32) * H**-0.5
    causal_ts = (start + jnp.arange(T))[:, None] >= jnp.arange(k_bskh.shape[1])[None, :]
    scores_bkgts = jnp.where(causal_ts, scores_bkgts, jnp.finfo(jnp.float32).min)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return o_btkgh.reshape(B, T, N, H)


def mlp_block(x_btd, p, cfg: ModelConfig, dtype):
    h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps)
    # Gate and up in one einsum, for the same reason as q, k, v: one input-gradient all-reduce.
    w_dsf = jnp.stack([p["w_gate"], p["w_up"]], axis=1)
    gate_up_btsf = jnp.einsum("btd,dsf->btsf", h_btd, w_dsf.astype(dtype))
    hidden_btf = jax.nn.silu(gate_up_btsf[:, :, 0]) * gate_up_btsf[:, :, 1]
    hidden_btf = constrain(hidden_btf, (BATCH, LENGTH, MLP))
    return jnp.einsum("btf,fd->btd", hidden_btf, p["w_down"].astype(dtype))
