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

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LAYERS, LENGTH, MLP, RES_LENGTH, VOCAB
from shard.models import moe
from shard.models.configs import ModelConfig
from shard.parallel.ring_attention import context_axes, ring_attention
from shard.rules import constrain

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
        self.embed = _param(rngs, (V, D), (VOCAB, EMBED), 1.0, dt)  # table_vd
        attn = dict(
            attn_norm=_param(rngs, (L, D), (LAYERS, EMBED), None, dt),
            wq=_param(rngs, (L, D, N, H), (LAYERS, EMBED, HEADS, HEAD_DIM), D**-0.5, dt),
            wk=_param(rngs, (L, D, K, H), (LAYERS, EMBED, KV_HEADS, HEAD_DIM), D**-0.5, dt),
            wv=_param(rngs, (L, D, K, H), (LAYERS, EMBED, KV_HEADS, HEAD_DIM), D**-0.5, dt),
            wo=_param(rngs, (L, N, H, D), (LAYERS, HEADS, HEAD_DIM, EMBED), (N * H) ** -0.5 * out_std, dt),
            mlp_norm=_param(rngs, (L, D), (LAYERS, EMBED), None, dt),
        )
        if cfg.n_experts:
            ffn = moe.expert_params(rngs, cfg, out_std, _param)
        else:
            ffn = dict(
                w_gate=_param(rngs, (L, D, F), (LAYERS, EMBED, MLP), D**-0.5, dt),
                w_up=_param(rngs, (L, D, F), (LAYERS, EMBED, MLP), D**-0.5, dt),
                w_down=_param(rngs, (L, F, D), (LAYERS, MLP, EMBED), F**-0.5 * out_std, dt),
            )
        self.layers = nnx.Dict(**attn, **ffn)
        self.final_norm = _param(rngs, (D,), (EMBED,), None, dt)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (D, V), (EMBED, VOCAB), D**-0.5, dt)  # w_dv

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Next-token logits (float32) for a batch of token ids."""
        return self.forward(tokens_bt)[0]

    def forward(self, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Logits and the load-balancing auxiliary loss (0 for a dense model)."""
        return forward(self.cfg, nnx.to_pure_dict(nnx.state(self)), tokens_bt)


# The forward pass as pure functions of the parameter dict, so that pipeline parallelism can run the
# same embedding, layer block and head on its own schedule (shard/parallel/pipeline.py).


def forward(cfg: ModelConfig, params: dict, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    x_btd = embed_tokens(cfg, params, tokens_bt)
    x_btd, aux = run_layers(cfg, params["layers"], x_btd)
    return head_logits(cfg, params, x_btd), aux


def embed_tokens(cfg: ModelConfig, params: dict, tokens_bt: jax.Array) -> jax.Array:
    x_btd = jnp.take(params["embed"], tokens_bt, axis=0).astype(compute_dtype(cfg))
    return constrain(x_btd, (BATCH, RES_LENGTH, EMBED))


def run_layers(cfg: ModelConfig, layers: dict, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scan the layer block over a stack of layers (all of them, or one pipeline stage's slice);
    returns the residual stream and the summed auxiliary loss."""
    dtype = compute_dtype(cfg)
    cos_th, sin_th = rope_tables(x_btd.shape[1], cfg.head_dim, cfg.rope_theta)

    def block(x_btd, p):
        x_btd = x_btd + attention_block(x_btd, p, cos_th, sin_th, cfg, dtype)
        if cfg.n_experts:
            ffn_btd, aux = moe.moe_block(rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps), p, cfg, dtype)
        else:
            ffn_btd, aux = mlp_block(x_btd, p, cfg, dtype), jnp.zeros((), jnp.float32)
        return constrain(x_btd + ffn_btd, (BATCH, RES_LENGTH, EMBED)), aux

    if cfg.remat != "none":
        block = jax.checkpoint(block, policy=_REMAT[cfg.remat], prevent_cse=False)
    x_btd, aux_l = jax.lax.scan(block, x_btd, layers)
    return x_btd, jnp.sum(aux_l)


def head_logits(cfg: ModelConfig, params: dict, x_btd: jax.Array) -> jax.Array:
    dtype = compute_dtype(cfg)
    x_btd = rms_norm(x_btd, params["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings:
        logits_btv = jnp.einsum("btd,vd->btv", x_btd, params["embed"].astype(dtype)) * cfg.d_model**-0.5
    else:
        logits_btv = jnp.einsum("btd,dv->btv", x_btd, params["unembed"].astype(dtype))
    return constrain(logits_btv.astype(jnp.float32), (BATCH, LENGTH, VOCAB))


def rms_norm(x, scale, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(length: int, head_dim: int, theta: float):
    """cos/sin of shape (T, H) in the rotate-half layout used by Llama checkpoints."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles_th = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles_th = jnp.concatenate([angles_th, angles_th], axis=-1)
    return jnp.cos(angles_th), jnp.sin(angles_th)


def apply_rope(x_btnh, cos_th, sin_th):
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_btnh.astype(jnp.float32) * cos_th[:, None, :] + rotated * sin_th[:, None, :]
    return out.astype(x_btnh.dtype)


def attention_block(x_btd, p, cos_th, sin_th, cfg: ModelConfig, dtype):
    h_btd = rms_norm(x_btd, p["attn_norm"], cfg.norm_eps)
    q_btnh = jnp.einsum("btd,dnh->btnh", h_btd, p["wq"].astype(dtype))
    k_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["wk"].astype(dtype))
    v_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["wv"].astype(dtype))
    q_btnh = constrain(apply_rope(q_btnh, cos_th, sin_th), (BATCH, LENGTH, HEADS, HEAD_DIM))
    k_btkh = constrain(apply_rope(k_btkh, cos_th, sin_th), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v_btkh = constrain(v_btkh, (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    o_btnh = causal_attention(q_btnh, k_btkh, v_btkh, cfg.attention)
    o_btnh = constrain(o_btnh, (BATCH, LENGTH, HEADS, HEAD_DIM))
    return jnp.einsum("btnh,nhd->btd", o_btnh, p["wo"].astype(dtype))


def causal_attention(q_btnh, k_bskh, v_bskh, impl: str):
    """Causal grouped-query attention; "xla" goes through jax.nn.dot_product_attention (cuDNN flash
    attention on GPU when it applies), "reference" is the plain einsum version used to check it.
    When the layout splits `length` over mesh axes (context parallel), ring attention runs instead."""
    if axes := context_axes():
        return ring_attention(q_btnh, k_bskh, v_bskh, axes, causal=True)
    if impl == "xla":
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True)
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H)
    scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh).astype(jnp.float32) * H**-0.5
    causal_ts = jnp.tril(jnp.ones((T, k_bskh.shape[1]), dtype=bool))
    scores_bkgts = jnp.where(causal_ts, scores_bkgts, jnp.finfo(jnp.float32).min)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return o_btkgh.reshape(B, T, N, H)


def mlp_block(x_btd, p, cfg: ModelConfig, dtype):
    h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps)
    gate_btf = jnp.einsum("btd,df->btf", h_btd, p["w_gate"].astype(dtype))
    up_btf = jnp.einsum("btd,df->btf", h_btd, p["w_up"].astype(dtype))
    hidden_btf = constrain(jax.nn.silu(gate_btf) * up_btf, (BATCH, LENGTH, MLP))
    return jnp.einsum("btf,fd->btd", hidden_btf, p["w_down"].astype(dtype))
