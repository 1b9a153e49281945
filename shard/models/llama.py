"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU (or a mixture of experts), grouped-query
attention. Model families are features of it switched on by the config (docs/models.md): q/k/v biases
(`qkv_bias`, Qwen2), per-head RMSNorm of queries and keys (`qk_norm`, Qwen3) and sliding-window attention
(`sliding_window`, Mistral), and Gemma 2 and 3's features: local and global layers alternating
(`global_every`), per-layer RoPE bases, soft-capped scores and logits, norms around each sublayer with
a (1 + w) scale, GeGLU and scaled embeddings.

The layers are stored stacked (a leading `layers` dim) and run with `lax.scan`, so compile time does
not grow with depth. Every parameter names its logical axes; key activations are pinned with
`constrain`. Mesh axes never appear here. The forward pass is pure functions of the parameter dict, so
pipeline parallelism (shard/parallel/pipeline.py) runs the same embedding, layer block and head on its
own schedule, and generation runs them with a KV cache.

Dimension letters (see shard.axes): B batch, T length, D embed, N heads, K kv_heads, G = N/K query
heads per kv head, H head_dim, F mlp, V vocab, L layers.

Packed rows (several whole documents per row) come with `segment_ids` (B, T), which document each token
belongs to (0: padding), and `positions` (B, T), each token's position within its document: a token
attends to the earlier tokens of its own segment only, and RoPE reads `positions`. Without them every
program is what it is for unpacked rows. cuDNN's flash attention is not used for packed rows (see
`causal_attention`).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LAYERS, LENGTH, MLP, RES_LENGTH, VOCAB
from shard.models import lora as adapters
from shard.models import moe
from shard.errors import ShardError
from shard.config.model import ModelConfig, attention_backend, attention_chunks, cudnn_attention_problem
from shard.config.train import LoraConfig
from shard.parallel.ring_attention import context_axes, ring_attention, zigzag_positions
from shard.sharding.queries import (auto_ways, heads_split_alike, pin_looked_up, queries_split_like_keys,
                                   stored_lookup_split)
from shard.sharding.rules import active_layout, constrain

# Logical axes of each per-layer weight of the dense model (stored with a leading LAYERS dim). Inside the
# scanned block every weight is pinned to these axes under the activation rules: the layout it is
# computed in. For FSDP that is where the weight is gathered (once per use), instead of leaving XLA free
# to move activations to the sharded weight. Weights are cast to the compute dtype first, so FSDP
# gathers (and reduce-scatters gradients) in bf16 on accelerators.
LAYER_AXES = {
    "attn_norm": (EMBED,),
    "wq": (EMBED, HEADS, HEAD_DIM),
    "wk": (EMBED, KV_HEADS, HEAD_DIM),
    "wv": (EMBED, KV_HEADS, HEAD_DIM),
    "bq": (HEADS, HEAD_DIM),  # qkv_bias
    "bk": (KV_HEADS, HEAD_DIM),
    "bv": (KV_HEADS, HEAD_DIM),
    "q_norm": (HEAD_DIM,),  # qk_norm
    "k_norm": (HEAD_DIM,),
    "wo": (HEADS, HEAD_DIM, EMBED),
    "post_attn_norm": (EMBED,),  # sandwich_norms
    "mlp_norm": (EMBED,),
    "post_mlp_norm": (EMBED,),
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
    return jnp.dtype(cfg.compute_dtype_on(jax.default_backend()))


def _param(rngs: nnx.Rngs, shape, axes, std: float | None, dtype) -> nnx.Param:
    """A parameter with its logical axes; std=None means ones (norm scales), 0 zeros (biases)."""
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.truncated_normal(rngs.params(), -3.0, 3.0, shape)).astype(dtype)
    return nnx.Param(value, out_sharding=axes)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        """`lora` (rank > 0): LoRA adapters beside its targets in every layer (shard.models.lora), made
        after every base weight, so the base weights are those of a model without them."""
        self.cfg = cfg
        D, L, N, K, H, F, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                               cfg.mlp_dim, cfg.padded_vocab)
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 1.0 / (2 * L) ** 0.5  # residual branches scaled down with depth (GPT-2)
        # tied: logits std ~1 (with embed_scale the looked-up rows are scaled up to std ~1 instead)
        self.embed = _param(rngs, (V, D), (VOCAB, EMBED), D**-0.5, dt)  # table_vd
        one = 0 if cfg.norm_plus_one else None  # a norm's weight: (1 + w) starts at 0
        std = {"attn_norm": one, "wq": D**-0.5, "wk": D**-0.5, "wv": D**-0.5,
               "wo": (N * H) ** -0.5 * out_std, "mlp_norm": one, "w_gate": D**-0.5, "w_up": D**-0.5,
               "w_down": F**-0.5 * out_std, "bq": 0, "bk": 0, "bv": 0, "q_norm": one, "k_norm": one,
               "post_attn_norm": one, "post_mlp_norm": one}
        shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, K, H), "wv": (D, K, H), "wo": (N, H, D),
                  "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D), "bq": (N, H),
                  "bk": (K, H), "bv": (K, H), "q_norm": (H,), "k_norm": (H,), "post_attn_norm": (D,),
                  "post_mlp_norm": (D,)}
        off = {"bq", "bk", "bv"} if not cfg.qkv_bias else set()
        off |= {"q_norm", "k_norm"} if not cfg.qk_norm else set()
        off |= {"post_attn_norm", "post_mlp_norm"} if not cfg.sandwich_norms else set()
        off |= {"w_gate", "w_up", "w_down"} if cfg.n_experts else set()
        names = [n for n in LAYER_AXES if n not in off]
        layers = {n: _param(rngs, (L, *shapes[n]), (LAYERS, *LAYER_AXES[n]), std[n], dt) for n in names}
        if cfg.n_experts:
            layers |= moe.expert_params(rngs, cfg, out_std, _param)
        self.final_norm = _param(rngs, (D,), (EMBED,), one, dt)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (D, V), (EMBED, VOCAB), D**-0.5, dt)  # w_dv
        if lora is not None and lora.rank:
            layers |= adapters.adapter_params(rngs, lora, shapes, LAYER_AXES, L, _param, dt)
        self.layers = nnx.Dict(layers)

    def __call__(self, tokens_bt: jax.Array, cache: dict | None = None, start=0,
                 router_bias: jax.Array | None = None):
        """Next-token logits (float32) for a batch of token ids.

        With a KV cache (`init_cache`), the tokens sit at positions start.. and attend to everything
        cached before them; returns (logits, updated cache). This is the prefill and decode path of
        `shard generate`; training calls it without a cache. `router_bias`: as in `forward`.
        """
        params = nnx.to_pure_dict(nnx.state(self))
        if cache is None:
            return forward(self.cfg, params, tokens_bt, router_bias=router_bias)[0]
        table = tied_table(self.cfg, params, tokens_bt)
        x_btd = embed_tokens(self.cfg, params, tokens_bt, table)
        x_btd, _, cache = run_layers(self.cfg, params["layers"], x_btd, cache, start, router_bias=router_bias)
        return head_logits(self.cfg, params, x_btd, table), cache


def forward(cfg: ModelConfig, params: dict, tokens_bt: jax.Array, zigzag: bool = False,
            segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
            router_bias: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Logits and the MoE statistics of `run_layers` ({"aux": the summed auxiliary loss, and for a MoE
    model "load" and "dropped"}). `zigzag`: the tokens are in ring attention's load-balanced
    order (`zigzag_positions` for the context-parallel ways of the active layout), and so are the logits.
    `segment_ids`, `positions`: (B, T) of packed rows (module docstring), in the tokens' order.
    `router_bias` (L, E): the balancing bias experts are chosen by (model.router_bias_update)."""
    x_btd, table, moe_stats = forward_hidden(cfg, params, tokens_bt, zigzag, segment_ids, positions, router_bias)
    return head_logits(cfg, params, x_btd, table), moe_stats


def forward_hidden(cfg: ModelConfig, params: dict, tokens_bt: jax.Array, zigzag: bool = False,
                   segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                   router_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None, dict]:
    """`forward` up to the head: the residual stream after the last layer, the tied table the head is to
    share with the lookup (`tied_table`; None otherwise) and the MoE statistics. The loss runs the head
    itself, in chunks (shard.models.xent)."""
    table = tied_table(cfg, params, tokens_bt)
    x_btd = embed_tokens(cfg, params, tokens_bt, table)
    x_btd, moe_stats = run_layers(cfg, params["layers"], x_btd, zigzag=zigzag, segment_ids=segment_ids,
                                  positions=positions, router_bias=router_bias)
    return x_btd, table, moe_stats


def compute_weight(w: jax.Array, logical_axes: tuple[str, ...], dtype) -> jax.Array:
    """A stored weight in the compute dtype and layout, cast where it is stored and then gathered
    (FSDP), so the all-gather, and the reduce-scatter of its gradient, move compute-dtype bytes. Cast
    and constrained to the compute layout alone, sharding propagation moved the cast after the gather,
    which then moved float32 (tiny, fsdp=8, bfloat16: every all-gather float32)."""
    if w.dtype == dtype:
        return constrain(w, logical_axes)
    return constrain(constrain(w.astype(dtype), logical_axes, param=True), logical_axes)


def _table(cfg: ModelConfig, params: dict) -> jax.Array:
    """The embedding table in its compute layout and dtype (FSDP: gathered in the compute dtype)."""
    return compute_weight(params["embed"], (VOCAB, EMBED), compute_dtype(cfg))


def tied_table(cfg: ModelConfig, params: dict, tokens_bt: jax.Array) -> jax.Array | None:
    """With tied embeddings and a lookup that reads the compute-layout table, `_table` made once for the
    lookup and the logits to share (made by each, it was cast twice and gathered twice); None otherwise
    (made before the layers for the logits alone, it would be held through them)."""
    if not cfg.tie_embeddings or stored_lookup_split(cfg.padded_vocab, tokens_bt.size):
        return None
    return _table(cfg, params)


def embed_tokens(cfg: ModelConfig, params: dict, tokens_bt: jax.Array, table: jax.Array | None = None) -> jax.Array:
    """The token lookup. Under FSDP, when the tokens are fewer than the table's rows (a large vocab),
    it reads the table as stored instead of a gathered copy: each device holds a slice of the embed
    dim of every row, looks up the tokens of all the devices it shares that split with (the ids are
    small) in its slice, and the gradient scatters into that slice locally, with no full-table
    gradient to all-reduce (2 x 33 MB per device on the CPU reference config). Otherwise (a small
    vocab, data or vocab parallel) it reads the compute-layout table of `_table` (`table`, when given)."""
    split = stored_lookup_split(cfg.padded_vocab, tokens_bt.size)
    if split:
        table = constrain(params["embed"].astype(compute_dtype(cfg)), (VOCAB, EMBED), param=True)
        x_btd = pin_looked_up(jnp.take(table, constrain(tokens_bt, (BATCH, LENGTH), drop=split), axis=0), split)
    else:  # the whole sequence, as the vocab-split table looks it up (SP then splits it on the way out)
        table = table if table is not None else _table(cfg, params)
        x_btd = constrain(jnp.take(table, tokens_bt, axis=0, mode="clip"), (BATCH, LENGTH, EMBED))
    if cfg.embed_scale:  # Gemma: sqrt(d_model) in the compute dtype, as transformers rounds it
        x_btd = x_btd * jnp.asarray(cfg.d_model**0.5, x_btd.dtype)
    return constrain(x_btd, (BATCH, RES_LENGTH, EMBED))


def run_layers(cfg: ModelConfig, layers: dict, x_btd: jax.Array, cache: dict | None = None, start=0,
               zigzag: bool = False, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               router_bias: jax.Array | None = None, first_layer=0):
    """Scan the layer block over a stack of layers (all of them, or one pipeline stage's slice);
    returns the residual stream and the MoE statistics ({"aux": the summed auxiliary loss; for a MoE
    model also "load" (L, E), the (token, choice) pairs each layer routed to each expert, and "dropped"
    (L,), those its capacity dropped}), and with a KV cache (positions start..) the updated cache as
    well. `zigzag`, `segment_ids`, `positions`, `router_bias`: as in `forward` (given positions are
    already in the zig-zag order, as the batch is). `first_layer`: the index of the stack's first layer
    in the model (a pipeline stage's, traced there), which layers alternating local and global
    attention (cfg.global_every) need."""
    dtype = compute_dtype(cfg)
    T = x_btd.shape[1]
    if positions is not None:  # per row: (B, T, H) tables
        rope_at = constrain(positions, (BATCH, LENGTH))
    else:
        rope_at = jnp.asarray(zigzag_positions(T, active_layout().degree(LENGTH)) if zigzag else start + jnp.arange(T))
    cos_th, sin_th = rope_tables(rope_at, cfg)
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    if cfg.windows_vary:  # each layer's window (0: global) and, with rope_local_theta, its RoPE tables
        local_l = (first_layer + jnp.arange(n_layers) + 1) % cfg.global_every != 0
        window_l = jnp.where(local_l, cfg.sliding_window, 0)
        local_rope = rope_tables(rope_at, cfg, local=True) if cfg.rope_local_theta else None
    else:
        window_l, local_rope = None, None
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("packed rows (segment_ids) are for training and evaluation, not a KV cache")
        segment_ids = constrain(segment_ids, (BATCH, LENGTH))

    def block(x_btd, xs):
        p, kv, bias_e, window, key = xs
        cos, sin = cos_th, sin_th
        if local_rope is not None:
            cos, sin = (jnp.where(window > 0, a, b) for a, b in zip(local_rope, (cos_th, sin_th)))
        window = cfg.sliding_window if window is None else window
        # each weight in its compute layout (FSDP: gathered once, kept for the backward); norm scales and
        # the router (its softmax is float32) keep their dtype; LoRA adapters as their base weights
        axes = LAYER_AXES | moe.EXPERT_AXES if cfg.n_experts else LAYER_AXES
        axes = axes | {k: adapters.adapter_axes(k, LAYER_AXES) for k in p if adapters.is_adapter(k)}
        p = {k: constrain(v, axes[k]) if k.endswith("norm") or k == "router" else compute_weight(v, axes[k], dtype)
             for k, v in p.items()}
        if key is not None:
            p["dropout_key"] = key
        attn_btd, kv = attention_block(x_btd, p, cos, sin, cfg, dtype, kv, start, zigzag, segment_ids, window)
        if cfg.sandwich_norms:
            attn_btd = norm(cfg, attn_btd, p["post_attn_norm"])
        x_btd = x_btd + attn_btd
        if cfg.n_experts:
            # generation (a cache) drops no token: a prompt's capacity would differ from each decode step's
            ffn_btd, aux, counts = moe.moe_block(norm(cfg, x_btd, p["mlp_norm"]), p, cfg, dtype,
                                                 dropless=cache is not None, bias_e=bias_e)
            stats = {"aux": aux, **counts}
        else:
            ffn_btd, stats = mlp_block(x_btd, p, cfg, dtype), {"aux": jnp.zeros((), jnp.float32)}
        if cfg.sandwich_norms:
            ffn_btd = norm(cfg, ffn_btd, p["post_mlp_norm"])
        return constrain(x_btd + ffn_btd, (BATCH, RES_LENGTH, EMBED)), (stats, kv)

    # remat is for training: generating (a cache) saves nothing for a backward pass, and a checkpointed
    # block would trace the split cache's static windows
    if cache is None and (remat := cfg.remat_on(jax.default_backend())) != "none":
        block = jax.checkpoint(block, policy=_REMAT[remat], prevent_cse=False)
    if router_bias is not None:  # chooses experts only: no gradient
        router_bias = jax.lax.stop_gradient(router_bias.astype(jnp.float32))
    if cache is not None and "k_local" in cache:  # local layers in a rolling cache of their own
        return _unrolled_with_split_cache(cfg, block, layers, x_btd, cache, router_bias)
    keys = adapters.dropout_keys(jax.tree.leaves(layers)[0].shape[0])  # LoRA dropout while training
    x_btd, (stats_l, new_cache) = jax.lax.scan(block, x_btd, (layers, cache, router_bias, window_l, keys))
    stats = {**stats_l, "aux": jnp.sum(stats_l["aux"])}
    if "z" in stats:  # a MoE model's router z-loss, summed over layers as the aux loss is
        stats["z"] = jnp.sum(stats_l["z"])
    return (x_btd, stats) if cache is None else (x_btd, stats, new_cache)


def _unrolled_with_split_cache(cfg: ModelConfig, block, layers: dict, x_btd, cache: dict, router_bias):
    """Generation for layers whose windows differ (Gemma): the layers one after another (a scan needs one
    cache shape), each local layer reading and writing its rolling cache of the window ("k_local",
    "v_local"), each global one the whole context ("k", "v"); init_cache makes both."""
    new = {"": [], "_local": []}
    aux = jnp.zeros((), jnp.float32)
    for i, window in enumerate(cfg.layer_windows()):
        part = "_local" if window else ""
        j = len(new[part])
        kv = {"k": cache["k" + part][j], "v": cache["v" + part][j]}
        p = jax.tree.map(lambda a, i=i: a[i], layers)
        bias = None if router_bias is None else router_bias[i]
        x_btd, (stats, kv) = block(x_btd, (p, kv, bias, window, None))
        aux = aux + stats["aux"]
        new[part].append(kv)
    out = {}
    for part, kvs in new.items():
        for name in ("k", "v"):
            out[name + part] = jnp.stack([kv[name] for kv in kvs]) if kvs else cache[name + part]
    return x_btd, {"aux": aux}, out


def head_logits(cfg: ModelConfig, params: dict, x_btd: jax.Array, table: jax.Array | None = None) -> jax.Array:
    """float32 logits: the matmul accumulates and writes float32 (not bf16 rounded, then cast). Tied:
    through `_table` (`table`, when given)."""
    dtype = compute_dtype(cfg)
    x_btd = norm(cfg, x_btd, params["final_norm"])
    if cfg.tie_embeddings:
        logits_btv = _logits_einsum("btd,vd->btv", x_btd, table if table is not None else _table(cfg, params))
    else:
        w_dv = compute_weight(params["unembed"], (EMBED, VOCAB), dtype)
        logits_btv = _logits_einsum("btd,dv->btv", x_btd, w_dv)
    return mask_padded_vocab(cfg, soft_cap(constrain(logits_btv, (BATCH, LENGTH, VOCAB)), cfg.final_softcap))


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); x itself for cap 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def mask_padded_vocab(cfg: ModelConfig, logits_btv: jax.Array) -> jax.Array:
    """The logits of the padded ids (cfg.vocab_size.. cfg.padded_vocab - 1) at float32's lowest value, so
    the loss's logsumexp, softmax and sampling give them no mass (and their rows no gradient); the
    logits as they are where the vocabulary needs no padding (the same program)."""
    if cfg.padded_vocab == cfg.vocab_size:
        return logits_btv
    real_v = jnp.arange(logits_btv.shape[-1]) < cfg.vocab_size
    return jnp.where(real_v, logits_btv, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logits_einsum(subscripts: str, x, w):
    """The output head's matmul, written in float32; its two backward matmuls run in the inputs' dtype.
    Plain autodiff would feed them the float32 logits' gradient: float32 (TF32 on GPUs, half bf16's
    rate) matmuls of 4 x embed x vocab FLOPs per token, 13% of a 1B model's at vocab 128k, reading a
    float32 (B, T, V) tensor twice. The gradient is rounded to the compute dtype as bf16 logits' would
    be; the forward's loss keeps its float32 logits. With float32 inputs this is plain autodiff."""
    return jnp.einsum(subscripts, x, w, preferred_element_type=jnp.float32)


def _logits_einsum_fwd(subscripts: str, x, w):
    return _logits_einsum(subscripts, x, w), (x, w)


def _logits_einsum_bwd(subscripts: str, saved, g):
    x, w = saved
    _, pullback = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), x, w)
    return pullback(g.astype(jnp.result_type(x, w)))


_logits_einsum.defvjp(_logits_einsum_fwd, _logits_einsum_bwd)


CACHE_AXES = (LAYERS, BATCH, LENGTH, KV_HEADS, HEAD_DIM)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache: k and v of shape (L, B, S, K, H) in the compute dtype; S is max_len, or where
    every layer has the same window shorter than that (Mistral), the window: a rolling cache
    (`rolling_cache`) that keeps the last `sliding_window` positions only. Where local and global layers
    alternate (Gemma) and the window is shorter than max_len, the global layers' k and v (max_len) and
    the local layers' "k_local" and "v_local" (the window) are two stacks."""
    window, dtype = cfg.sliding_window, compute_dtype(cfg)
    rolling = 0 < window < max_len

    def stack(layers, length):
        shape = (layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        return jnp.zeros(shape, dtype)

    if rolling and cfg.windows_vary:
        local = sum(1 for w in cfg.layer_windows() if w)
        return {"k": stack(cfg.n_layers - local, max_len), "v": stack(cfg.n_layers - local, max_len),
                "k_local": stack(local, window), "v_local": stack(local, window)}
    length = window if rolling else max_len
    return {"k": stack(cfg.n_layers, length), "v": stack(cfg.n_layers, length)}


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
    (B, T, H) for per-row positions (B, T) (packed rows). `local`: the windowed layers' (rope_local_theta)."""
    inv_freq = jnp.asarray(cfg.rope_frequencies(local))
    if positions_t.ndim == 2:
        angles_bth = positions_t.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
        angles_bth = jnp.concatenate([angles_bth, angles_bth], axis=-1)
        return jnp.cos(angles_bth), jnp.sin(angles_bth)
    angles_th = positions_t.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles_th = jnp.concatenate([angles_th, angles_th], axis=-1)
    return jnp.cos(angles_th), jnp.sin(angles_th)


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
                    segment_ids=None, window=None):
    """Pre-norm attention; returns (output, kv). With a cache slice `kv` ({k, v}: (B, S, K, H)) the new
    keys and values are written at `start` and the queries attend to the whole cache, masked by position.
    `zigzag`, `segment_ids`: as in `forward`. `window`: this layer's (0: none; traced where layers
    differ, cfg.global_every); None: cfg.sliding_window."""
    window = cfg.sliding_window if window is None else window
    scale = (cfg.query_scale or cfg.head_dim) ** -0.5
    # Megatron-SP: the residual stream's length shards are gathered here, once, for the matmuls (left
    # free, XLA gathered the weights instead and moved q, k, v all-to-all); a no-op without SP.
    h_btd = constrain(norm(cfg, x_btd, p["attn_norm"]), (BATCH, LENGTH, EMBED))
    q_btnh, k_btkh, v_btkh = _qkv(h_btd, p, dtype)
    if cfg.qk_norm:  # Qwen3: each head's query and key normalised over head_dim, before RoPE
        q_btnh, k_btkh = norm(cfg, q_btnh, p["q_norm"]), norm(cfg, k_btkh, p["k_norm"])
    q_btnh = constrain(apply_rope(q_btnh, cos_th, sin_th), (BATCH, LENGTH, HEADS, HEAD_DIM))
    k_btkh = constrain(apply_rope(k_btkh, cos_th, sin_th), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v_btkh = constrain(v_btkh, (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
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
    out_btd = jnp.einsum("btnh,nhd->btd", o_btnh, p["wo"].astype(dtype))
    return adapters.with_delta(out_btd, o_btnh, p, "wo", p.get("dropout_key")), kv


def _qkv(h_btd, p, dtype):
    """q, k and v of the normalised residual.

    Where heads and kv heads are split alike, they come out of one einsum over a weight grouped by kv
    head, (D, K, G + 2, H): with heads split for tensor parallel, the backward pass then all-reduces
    one input gradient, not three. The grouping is local to each device and leaves the parameters as
    they are. Where kv heads are split otherwise (replicated by `rules.kv_heads=none` while heads are
    split), grouping would move weights between devices (collective permutes, which deadlock inside
    the 1F1B pipeline's per-stage branches), so three einsums run instead. The biases of qkv_bias
    (`bq`, `bk`, `bv`) are grouped as their weights are. LoRA adapters add their terms to q, k and v.
    """
    q_btnh, k_btkh, v_btkh = _qkv_base(h_btd, p, dtype)
    key = p.get("dropout_key")
    return tuple(adapters.with_delta(y, h_btd, p, name, key)
                 for y, name in ((q_btnh, "wq"), (k_btkh, "wk"), (v_btkh, "wv")))


def _qkv_base(h_btd, p, dtype):
    D, N, H = p["wq"].shape
    K = p["wk"].shape[1]
    if not heads_split_alike():
        q_btnh = jnp.einsum("btd,dnh->btnh", h_btd, p["wq"].astype(dtype))
        k_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["wk"].astype(dtype))
        v_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["wv"].astype(dtype))
        if "bq" in p:
            q_btnh, k_btkh, v_btkh = (q_btnh + p["bq"].astype(dtype), k_btkh + p["bk"].astype(dtype),
                                      v_btkh + p["bv"].astype(dtype))
        return q_btnh, k_btkh, v_btkh
    w_dkgh = jnp.concatenate([p["wq"].reshape(D, K, N // K, H), p["wk"][:, :, None], p["wv"][:, :, None]], 2)
    qkv_btkgh = jnp.einsum("btd,dkgh->btkgh", h_btd, w_dkgh.astype(dtype))
    if "bq" in p:
        b_kgh = jnp.concatenate([p["bq"].reshape(K, N // K, H), p["bk"][:, None], p["bv"][:, None]], 1)
        qkv_btkgh = qkv_btkgh + b_kgh.astype(dtype)
    B, T = qkv_btkgh.shape[:2]
    return qkv_btkgh[:, :, :, : N // K].reshape(B, T, N, H), qkv_btkgh[:, :, :, -2], qkv_btkgh[:, :, :, -1]


def causal_attention(q_btnh, k_bskh, v_bskh, impl: str, zigzag: bool = False, segment_ids=None, window=0,
                     scale: float | None = None, softcap: float = 0.0, chunk: int = 0):
    """Causal grouped-query attention. `impl` is model.attention: "cudnn" is cuDNN's flash attention and
    "xla" XLA's attention, both through jax.nn.dot_product_attention; "auto" is cuDNN's where it applies
    (configs.attention_backend), XLA's otherwise; "reference" is the plain einsum version that checks
    them. When the layout splits `length` over mesh axes (context parallel), ring attention runs instead,
    load-balanced where the sequence comes in its zig-zag order (`zigzag`).

    `segment_ids` (B, T): packed rows; a query attends only to keys of its own segment. XLA's attention
    takes that as a (B, 1, T, T) mask. cuDNN is not used for them: jax.nn.dot_product_attention hands
    cuDNN a mask only as a dense bias (a (B, 1, T, T) tensor read by the kernel, and the bias variant of
    it), which gives up the O(T) memory flash attention is chosen for; cuDNN's own packed layout
    (per-row segment offsets and lengths, `q_offsets`/`kv_offsets`) is reachable only through the private
    jax._src.cudnn API, needs Hopper and a static bound on documents per row, and cannot be checked
    without a GPU. So "auto" runs XLA's attention for packed rows and "cudnn" by name is an error.

    `window` > 0 (model.sliding_window): a query at position t attends to keys at t - window + 1 .. t
    only. XLA's and cuDNN's attention take it as `local_window_size=(window - 1, 0)` (JAX: t - s <=
    left; cuDNN gets `left + 1` with an exclusive bound); ring attention has no window and refuses.

    `scale`: the scores' factor (None: head_dim ** -0.5). A window that differs by layer (a traced
    `window`, Gemma's local and global layers) or soft-capped scores (`softcap`, Gemma 2) run the
    einsum version, which takes both (jax.nn.dot_product_attention takes neither); so does "cudnn"
    by name refuse them.

    `chunk` (model.attention_chunk: queries per chunk, -1 auto, 0 off): XLA's attention and the einsum
    version take the queries in chunks (`query_chunked`), so one chunk's scores exist at a time; cuDNN's
    and ring attention hold no scores, and "reference" runs whole."""
    special = isinstance(window, jax.Array) or softcap
    if axes := context_axes():
        what = ("model.attn_softcap" if softcap else "a window of some layers (model.global_every)"
                if isinstance(window, jax.Array) else f"model.sliding_window={window}" if window else "")
        if what:
            raise ShardError(f"{what} can't run with context parallelism (`length` split over {'x'.join(axes)}): "
                             "ring attention has no sliding window or soft-capping; split the batch instead")
        if impl == "cudnn":  # asked for by name: say it can't run, as everywhere else it can't
            raise ShardError("model.attention=cudnn can't run here: context parallelism (`length` split over "
                             f"{'x'.join(axes)}) uses ring attention; use auto")
        if scale is not None and scale != q_btnh.shape[-1] ** -0.5:
            raise ShardError("model.query_scale can't run with context parallelism: ring attention scales by "
                             "head_dim ** -0.5; split the batch instead")
        if segment_ids is not None:
            return ring_attention(q_btnh, k_bskh, v_bskh, axes, causal=True, zigzag=zigzag, segment_ids=segment_ids)
        return ring_attention(q_btnh, k_bskh, v_bskh, axes, causal=True, zigzag=zigzag)
    if special:
        if impl == "cudnn":
            raise ShardError("model.attention=cudnn can't run here: soft-capped scores or windows that differ by "
                             "layer (Gemma) run the einsum attention; use auto")
        return query_chunked(lambda q, at, seg_q: cached_attention(q, k_bskh, v_bskh, at, seg_q, window, scale,
                                                                   softcap, key_segment_ids=segment_ids),
                             q_btnh, segment_ids, _query_chunks(q_btnh, chunk))
    if impl in ("auto", "cudnn"):
        problem = _cudnn_problem(q_btnh, segments=segment_ids is not None)
        if impl == "cudnn" and problem:
            raise ShardError(f"model.attention=cudnn can't run here: {problem}; use auto or xla")
        impl = attention_backend(impl, problem)
    if impl == "xla" and (n := _query_chunks(q_btnh, chunk)) > 1:
        return query_chunked(lambda q, at, seg_q: _xla_attention_at(q, k_bskh, v_bskh, at, seg_q, segment_ids,
                                                                    window, scale), q_btnh, segment_ids, n)
    if impl in ("cudnn", "xla"):
        local = (window - 1, 0) if window else None
        if segment_ids is not None:
            same_bts = segment_ids[:, :, None] == segment_ids[:, None, :]
            return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=same_bts[:, None], scale=scale,
                                                is_causal=True, local_window_size=local, implementation=impl)
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, scale=scale, is_causal=True,
                                            local_window_size=local, implementation=impl)
    return cached_attention(q_btnh, k_bskh, v_bskh, 0, segment_ids, window, scale)


def _query_chunks(q_btnh, chunk: int) -> int:
    """attention_chunks for these queries under the active layout (rows and heads per device)."""
    B, T, N, _ = q_btnh.shape
    return attention_chunks(chunk, T, max(B // auto_ways(BATCH), 1), max(N // auto_ways(HEADS), 1))


def query_chunked(attend, q_btnh, segment_ids, n: int):
    """attend(q, start, seg_q) over `n` contiguous chunks of the queries, one after another: chunk i is
    q (B, T/n, N, H) at positions start = i T/n.., with its segment ids seg_q (B, T/n) (None without
    packed rows), and attends to all the keys, its softmax exact. Each chunk is recomputed in the
    backward pass (jax.checkpoint), so the forward and the backward hold one chunk's scores at a time,
    not (B, N, T, T) of them; the price is the scores' matmul and softmax once more. n = 1: attend itself."""
    if n <= 1:
        return attend(q_btnh, 0, segment_ids)
    B, T, N, H = q_btnh.shape
    c = T // n
    q_nbtnh = jnp.moveaxis(q_btnh.reshape(B, n, c, N, H), 1, 0)  # (chunks, batch, T/n, heads, head_dim)
    seg_nbt = None if segment_ids is None else jnp.moveaxis(segment_ids.reshape(B, n, c), 1, 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(xs):
        i, q, seg_q = xs
        q = constrain(q, (BATCH, LENGTH, HEADS, HEAD_DIM))
        return constrain(attend(q, i * c, seg_q), (BATCH, LENGTH, HEADS, HEAD_DIM))

    o_nbtnh = jax.lax.map(one, (jnp.arange(n), q_nbtnh, seg_nbt))
    return jnp.moveaxis(o_nbtnh, 0, 1).reshape(B, T, N, H)


def _xla_attention_at(q_btnh, k_bskh, v_bskh, start, seg_q, segment_ids, window, scale):
    """XLA's attention (jax.nn.dot_product_attention) of queries at positions start.. over keys at
    0..S-1: causal, within `window` (0: none) and, with packed rows, the query's own segment (`seg_q` of
    the queries, `segment_ids` of the keys), as one boolean mask; the same scores, softmax and masked
    value as its is_causal and local_window_size give the whole sequence."""
    back_ts = (start + jnp.arange(q_btnh.shape[1]))[:, None] - jnp.arange(k_bskh.shape[1])[None, :]
    allowed_ts = (back_ts >= 0) & (back_ts < window) if window else back_ts >= 0
    mask = allowed_ts[None, None]  # (1, 1, T, S)
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == segment_ids[:, None, :])[:, None]  # (B, 1, T, S)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask, scale=scale, implementation="xla")


def _cudnn_problem(q_btnh, segments: bool = False) -> str:
    """cudnn_attention_problem for this trace: the backend JAX runs on, the inputs' dtype and head dim,
    the active layout's split of queries against keys, and whether the rows are packed (`segments`)."""
    backend = jax.extend.backend.get_backend()
    platform = "cuda" if backend.platform == "gpu" and "cuda" in backend.platform_version.lower() else backend.platform
    same_split = queries_split_like_keys()
    manual = bool(jax.sharding.get_abstract_mesh().manual_axes)
    return cudnn_attention_problem(platform=platform, dtype=jnp.dtype(q_btnh.dtype).name,
                                   head_dim=q_btnh.shape[-1], same_split=same_split, manual=manual,
                                   segments=segments)


def rolling_cache(kv: dict, window) -> bool:
    """Whether a layer's cache slice is init_cache's rolling one: as long as its (static) window."""
    return isinstance(window, int) and window > 0 and kv["k"].shape[1] == window


def rolling_attention(q_btnh, k_btkh, v_btkh, kv: dict, start, window: int, scale, softcap: float):
    """Attention of T new tokens at positions start.. over a rolling cache of the last `window` positions
    (slot j holds the latest position before start that is j modulo the window) and over themselves;
    then the last min(T, window) of them written into their slots. Returns (output, updated cache)."""
    W, T = kv["k"].shape[1], q_btnh.shape[1]
    slots = jnp.arange(W)
    held_s = start - 1 - jnp.mod(start - 1 - slots, W)  # negative: a slot not written yet
    key_pos = jnp.concatenate([jnp.where(held_s >= 0, held_s, -(2**30)), start + jnp.arange(T)])
    k_bskh = jnp.concatenate([kv["k"], k_btkh.astype(kv["k"].dtype)], axis=1)
    v_bskh = jnp.concatenate([kv["v"], v_btkh.astype(kv["v"].dtype)], axis=1)
    o_btnh = cached_attention(q_btnh, k_bskh, v_bskh, start, window=window, scale=scale, softcap=softcap,
                              key_positions=key_pos)
    n = min(T, W)  # the newest n: older ones of a long prompt fall out of the window anyway
    idx = jnp.mod(start + T - n + jnp.arange(n), W)
    kv = {"k": kv["k"].at[:, idx].set(k_btkh[:, T - n:].astype(kv["k"].dtype)),
          "v": kv["v"].at[:, idx].set(v_btkh[:, T - n:].astype(kv["v"].dtype))}
    return o_btnh, kv


def cached_attention(q_btnh, k_bskh, v_bskh, start, segment_ids=None, window=0, scale: float | None = None,
                     softcap: float = 0.0, key_positions=None, key_segment_ids=None):
    """Grouped-query attention of queries at positions start.. over keys at positions 0..S-1, causal.
    `segment_ids` (B, T), self-attention of packed rows only (start 0, S = T): keys of the query's
    own segment only. `window` > 0: keys less than `window` positions back only (the KV cache keeps
    every position and masks the older ones: it is not cut to the window); a traced window of 0 is
    none. `scale`: the scores' factor (None: head_dim ** -0.5); `softcap` > 0: scores soft-capped
    (soft_cap) before the mask. `key_positions` (S,): the keys' positions where they are not 0..S-1
    (a rolling cache's). `key_segment_ids` (B, S): the keys' segments where the queries are a chunk of
    the row (`query_chunked`); None: `segment_ids`."""
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H)
    scale = H**-0.5 if scale is None else scale
    scores_bkgts = soft_cap(jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh).astype(jnp.float32) * scale, softcap)
    key_s = jnp.arange(k_bskh.shape[1]) if key_positions is None else key_positions
    back_ts = (start + jnp.arange(T))[:, None] - key_s[None, :]
    if isinstance(window, jax.Array):
        causal_ts = (back_ts >= 0) & ((window == 0) | (back_ts < window))
    else:
        causal_ts = (back_ts >= 0) & (back_ts < window) if window else back_ts >= 0
    if segment_ids is not None:  # and the same segment: (B, 1, 1, T, S)
        same_bts = segment_ids[:, :, None] == (segment_ids if key_segment_ids is None else key_segment_ids)[:, None, :]
        scores_bkgts = jnp.where(causal_ts & same_bts[:, None, None], scores_bkgts, jnp.finfo(jnp.float32).min)
    else:
        scores_bkgts = jnp.where(causal_ts, scores_bkgts, jnp.finfo(jnp.float32).min)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return o_btkgh.reshape(B, T, N, H)


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(2,))
def _gated(gate, up, activation: str = "silu"):
    """act(gate) * up (SwiGLU, or GeGLU with tanh-approximate GELU), recomputed in the backward pass from
    gate and up: autodiff saved four more (B, T, mlp) tensors (the sigmoid, the silu, ...) under remat
    none."""
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return act * up


def mlp_block(x_btd, p, cfg: ModelConfig, dtype):
    h_btd = constrain(norm(cfg, x_btd, p["mlp_norm"]), (BATCH, LENGTH, EMBED))  # as in attention
    # Gate and up in one einsum, for the same reason as q, k, v: one input-gradient all-reduce.
    w_dsf = jnp.stack([p["w_gate"], p["w_up"]], axis=1)
    gate_up_btsf = jnp.einsum("btd,dsf->btsf", h_btd, w_dsf.astype(dtype))
    key = p.get("dropout_key")  # LoRA
    gate_btf = adapters.with_delta(gate_up_btsf[:, :, 0], h_btd, p, "w_gate", key)
    up_btf = adapters.with_delta(gate_up_btsf[:, :, 1], h_btd, p, "w_up", key)
    hidden_btf = constrain(_gated(gate_btf, up_btf, cfg.mlp_activation), (BATCH, LENGTH, MLP))
    return adapters.with_delta(jnp.einsum("btf,fd->btd", hidden_btf, p["w_down"].astype(dtype)), hidden_btf, p,
                               "w_down", key)
