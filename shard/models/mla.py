"""Multi-head latent attention (DeepSeek-V2/V3), the decoder's attention where model.kv_lora_rank > 0.

Keys and values come from one compressed latent per token, c_kv (kv_lora_rank wide, RMS-normalised),
through per-head up-projections (`wkv_b`: W_kb to the keys' non-RoPE part, W_vb to the values); queries from
a latent of q_lora_rank (`wq_a`, its norm, `wq_b`), or straight from the residual (`wq`) where
q_lora_rank is 0. RoPE is decoupled: each head's query has qk_rope_head_dim more dims that RoPE rotates,
and the key's are one projection of the residual (`wkv_a`'s last columns, beside the latent's) shared
by every head. RoPE rotates halves (shard.models.layers.apply_rope); DeepSeek's checkpoints pair the
rotated dims interleaved, which import-hf turns into halves (shard.run.hf). The parameters are
shard.config.params.mla_params'.

Training (no cache) up-projects the latent to full keys and values and runs the decoder's causal
attention (shard.models.attention), so every backend and ring attention apply; XLA's and cuDNN's take
one head dim for q, k and v, so values narrower than the scores' head_dim are padded with zeros and the
output cut back (what transformers does for flash attention).

Generation keeps the latent cache: per token the normalised c_kv and the rotated RoPE key, kv_lora_rank
+ qk_rope_head_dim numbers per layer instead of 2 N H; the up-projections are absorbed: the query's
non-RoPE part is projected into the latent space (q W_kb^T) and scores it against c_kv directly, and the
attention-weighted latent is projected to the values' space once per query (W_vb), so the cache is
never expanded.

Letters: B batch, T length (queries), S keys, D embed, N heads, C kv_lora_rank, Q q_lora_rank, P the
non-RoPE qk dims (qk_nope_head_dim), R qk_rope_head_dim, H = P + R, V v_head_dim.
"""

import jax
import jax.numpy as jnp

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, LATENT, LENGTH
from shard.config.model import ModelConfig
from shard.models import lora as adapters
from shard.models import matmuls
from shard.models.attention import causal_attention
from shard.models.layers import apply_rope, norm
from shard.sharding.rules import constrain

# transformers' and DeepSeek's latent norms use RMSNorm's default epsilon whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + LATENT_NORM_EPS)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def queries(h_btd, p, dtype):
    """Each head's query (B, T, N, H), from the query latent where there is one."""
    if "wq_a" in p:
        cq_btq = _rms(matmuls.einsum("btd,dq->btq", h_btd, p["wq_a"].astype(dtype)), p["q_a_norm"])
        cq_btq = constrain(cq_btq, (BATCH, LENGTH, LATENT))
        return matmuls.einsum("btq,qnh->btnh", cq_btq, p["wq_b"].astype(dtype))
    return matmuls.einsum("btd,dnh->btnh", h_btd, p["wq"].astype(dtype))


def latents(h_btd, p, dtype, cos_tr, sin_tr):
    """The key-value latent c_kv (B, T, C), normalised, and the rotated RoPE key (B, T, R): what the
    latent cache holds per token."""
    C = p["kv_a_norm"].shape[-1]
    ckv_kr_btx = matmuls.einsum("btd,dx->btx", h_btd, p["wkv_a"].astype(dtype))
    ckv_btc, kr_btr = _rms(ckv_kr_btx[..., :C], p["kv_a_norm"]), ckv_kr_btx[..., C:]
    kr_btr = apply_rope(kr_btr[:, :, None, :], cos_tr, sin_tr)[:, :, 0]
    return constrain(ckv_btc, (BATCH, LENGTH, LATENT)), kr_btr


def mla_attention(h_btd, p, cos_tr, sin_tr, cfg: ModelConfig, dtype, kv=None, start=0, zigzag: bool = False,
                  segment_ids=None, window=0):
    """The attention output (B, T, N, V) of the normalised residual, and the updated latent cache
    (`kv`: {"ckv": (B, S, C), "k_rope": (B, S, R)}, written at `start`; None without one)."""
    P = cfg.qk_nope_head_dim
    scale = cfg.attention_scale
    q_btnh = queries(h_btd, p, dtype)
    q_btnh = jnp.concatenate([q_btnh[..., :P], apply_rope(q_btnh[..., P:], cos_tr, sin_tr)], axis=-1)
    q_btnh = constrain(q_btnh, (BATCH, LENGTH, HEADS, HEAD_DIM))
    ckv_btc, kr_btr = latents(h_btd, p, dtype, cos_tr, sin_tr)
    if kv is not None:
        kv = {"ckv": jax.lax.dynamic_update_slice_in_dim(kv["ckv"], ckv_btc.astype(kv["ckv"].dtype), start, 1),
              "k_rope": jax.lax.dynamic_update_slice_in_dim(kv["k_rope"], kr_btr.astype(kv["k_rope"].dtype),
                                                            start, 1)}
        return absorbed_attention(q_btnh, kv["ckv"], kv["k_rope"], p, cfg, dtype, start, window, scale), kv
    kv_btnx = matmuls.einsum("btc,cnx->btnx", ckv_btc, p["wkv_b"].astype(dtype))
    k_btnp, v_btnv = kv_btnx[..., :P], constrain(kv_btnx[..., P:], (BATCH, LENGTH, HEADS, HEAD_DIM))
    B, T, N, H = q_btnh.shape
    k_btnh = jnp.concatenate([k_btnp, jnp.broadcast_to(kr_btr[:, :, None], (B, T, N, H - P))], axis=-1)
    k_btnh = constrain(k_btnh, (BATCH, LENGTH, HEADS, HEAD_DIM))
    V = v_btnv.shape[-1]
    width = max(H, V)  # one head dim for q, k and v: the narrower padded with zeros
    pad = [(0, 0)] * 3
    q_btnh, k_btnh = (jnp.pad(x, pad + [(0, width - H)]) for x in (q_btnh, k_btnh))
    v_btnv = jnp.pad(v_btnv, pad + [(0, width - V)])
    o_btnh = causal_attention(q_btnh, k_btnh, v_btnv, cfg.attention, zigzag, segment_ids, window, scale, 0.0,
                              cfg.attention_chunk)
    return o_btnh[..., :V], None


def absorbed_attention(q_btnh, ckv_bsc, kr_bsr, p, cfg: ModelConfig, dtype, start, window, scale: float):
    """Attention of queries at positions start.. over the latent cache (keys at 0..S-1, causal, within
    `window` where > 0), with the up-projections absorbed: scores = (q_nope W_kb^T) c_kv + q_rope k_rope,
    output = (probs c_kv) W_vb. Returns (B, T, N, V)."""
    P = cfg.qk_nope_head_dim
    w_cnx = p["wkv_b"].astype(dtype)
    qc_btnc = jnp.einsum("btnp,cnp->btnc", q_btnh[..., :P], w_cnx[..., :P])
    scores_bnts = (jnp.einsum("btnc,bsc->bnts", qc_btnc, ckv_bsc.astype(dtype))
                   + jnp.einsum("btnr,bsr->bnts", q_btnh[..., P:], kr_bsr.astype(dtype))).astype(jnp.float32)
    back_ts = (start + jnp.arange(q_btnh.shape[1]))[:, None] - jnp.arange(ckv_bsc.shape[1])[None, :]
    allowed_ts = (back_ts >= 0) & ((window == 0) | (back_ts < window))
    scores_bnts = jnp.where(allowed_ts, scores_bnts * scale, jnp.finfo(jnp.float32).min)
    probs_bnts = jax.nn.softmax(scores_bnts, axis=-1).astype(dtype)
    oc_btnc = jnp.einsum("bnts,bsc->btnc", probs_bnts, ckv_bsc.astype(dtype))
    return jnp.einsum("btnc,cnv->btnv", oc_btnc, w_cnx[..., P:])


def mla_block(x_btd, p, cos_tr, sin_tr, cfg: ModelConfig, dtype, kv=None, start=0, zigzag: bool = False,
              segment_ids=None, window=None):
    """Pre-norm multi-head latent attention, as shard.models.layers.attention_block: (output, cache)."""
    window = cfg.sliding_window if window is None else window
    h_btd = constrain(norm(cfg, x_btd, p["attn_norm"]), (BATCH, LENGTH, EMBED))
    o_btnv, kv = mla_attention(h_btd, p, cos_tr, sin_tr, cfg, dtype, kv, start, zigzag, segment_ids, window)
    o_btnv = constrain(o_btnv, (BATCH, LENGTH, HEADS, HEAD_DIM))
    out_btd = matmuls.einsum("btnv,nvd->btd", o_btnv, p["wo"].astype(dtype))
    return adapters.with_delta(out_btd, o_btnv, p, "wo", p.get("dropout_key")), kv
