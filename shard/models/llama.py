"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU (or a mixture of experts), grouped-query
attention. Model families are features of it switched on by the config (docs/models.md): q/k/v biases
(`qkv_bias`, Qwen2), per-head RMSNorm of queries and keys (`qk_norm`, Qwen3) and sliding-window attention
(`sliding_window`, Mistral), and Gemma 2 and 3's features: local and global layers alternating
(`global_every`), per-layer RoPE bases, soft-capped scores and logits, norms around each sublayer with
a (1 + w) scale, GeGLU and scaled embeddings.

The layers are stored stacked (a leading `layers` dim) and run with `lax.scan`, so compile time does
not grow with depth; a layer's sublayers (norms, RoPE, the attention block, the MLP) are
shard.models.layers, the attention itself shard.models.attention. Every parameter's shape, logical
axes and initial values are shard.config.params' tables; key activations are pinned with `constrain`.
Mesh axes never appear here. The forward pass is pure functions of the parameter dict, so
pipeline parallelism (shard/parallel/pipeline.py) runs the same embedding, layer block and head on its
own schedule, and generation runs them with a KV cache.

Dimension letters (see shard.axes): B batch, T length, D embed, N heads, K kv_heads, G = N/K query
heads per kv head, H head_dim, F mlp, V vocab, L layers.

Packed rows (several whole documents per row) come with `segment_ids` (B, T), which document each token
belongs to (0: padding), and `positions` (B, T), each token's position within its document: a token
attends to the earlier tokens of its own segment only, and RoPE reads `positions`. Without them every
program is what it is for unpacked rows. cuDNN's flash attention is not used for packed rows (see
`shard.models.attention.causal_attention`).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shard.axes import BATCH, EMBED, HEAD_DIM, KV_HEADS, LATENT, LAYERS, LENGTH, RES_LENGTH, VOCAB
from shard.models import lora as adapters
from shard.models import matmuls
from shard.models import moe
from shard.models.fp8 import stack_gathered, stack_recipes
from shard.models.mla import mla_block
from shard.models.attention import soft_cap
from shard.models.layers import attention_block, mlp_block, norm, rope_tables
from shard.config.model import ModelConfig
from shard.config.params import ParamSpec, dense_layer_params, layer_params, mtp_params, outer_params, stacked
from shard.config.finetune import LoraConfig
from shard.parallel.ring_attention import zigzag_positions
from shard.sharding.queries import pin_looked_up, stored_lookup_split
from shard.sharding.rules import active_layout, constrain

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
        dt, L = jnp.dtype(cfg.param_dtype), cfg.n_layers
        outer = outer_params(cfg)

        def make(p: ParamSpec) -> nnx.Param:
            return _param(rngs, p.shape, p.axes, p.init, dt)

        self.embed = make(outer["embed"])  # table_vd
        if cfg.dense_layers:  # DeepSeek-V3's dense first layers: a stack of their own, run first
            self.dense_layers = nnx.Dict({name: make(stacked(p, cfg.dense_layers))
                                          for name, p in dense_layer_params(cfg.dense_part).items()})
        L -= cfg.dense_layers
        layers = {name: make(stacked(p, L)) for name, p in layer_params(cfg).items()}
        self.final_norm = make(outer["final_norm"])
        if "unembed" in outer:
            self.unembed = make(outer["unembed"])  # w_dv
        if cfg.mtp_depth:  # multi-token prediction's modules (shard.models.mtp), after every decoder weight
            mtp = {name: make(p) for name, p in mtp_params(cfg).items()}
            layer = {n.split("/", 1)[1]: mtp.pop(n) for n in list(mtp) if n.startswith("layers/")}
            self.mtp = nnx.Dict(mtp | {"layers": nnx.Dict(layer)})
        if lora is not None and lora.rank:
            layers |= adapters.adapter_params(rngs, lora, dense_layer_params(cfg), L, _param, dt)
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
        x_btd, _, cache = run_stacks(self.cfg, params, x_btd, cache, start, router_bias=router_bias)
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
                   router_bias: jax.Array | None = None,
                   max_logits: bool = False) -> tuple[jax.Array, jax.Array | None, dict]:
    """`forward` up to the head: the residual stream after the last layer, the tied table the head is to
    share with the lookup (`tied_table`; None otherwise) and the MoE statistics. The loss runs the head
    itself, in chunks (shard.models.xent). `max_logits`: as in `run_layers`."""
    table = tied_table(cfg, params, tokens_bt)
    x_btd = embed_tokens(cfg, params, tokens_bt, table)
    x_btd, moe_stats = run_stacks(cfg, params, x_btd, zigzag=zigzag, segment_ids=segment_ids,
                                  positions=positions, router_bias=router_bias, max_logits=max_logits)
    return x_btd, table, moe_stats


def run_stacks(cfg: ModelConfig, params: dict, x_btd: jax.Array, cache: dict | None = None, start=0, **kw):
    """`run_layers` over the model's layer stacks: the dense first layers' (cfg.dense_layers, DeepSeek-V3)
    and then the main one; a cache's layers are split between them and joined again. A router bias's rows
    past the main stack's layers are the MTP modules' (shard.models.mtp)."""
    if kw.get("router_bias") is not None:
        kw = kw | {"router_bias": kw["router_bias"][:cfg.moe_layers]}
    history = params.get("fp8", {})  # training with fp8_delayed weights: their amax histories
    if not cfg.dense_layers:
        return run_layers(cfg, params["layers"], x_btd, cache, start, **kw, fp8_history=history.get("layers"))
    k = cfg.dense_layers
    parts = (None, None) if cache is None else (jax.tree.map(lambda a: a[:k], cache), jax.tree.map(lambda a: a[k:], cache))
    first = run_layers(cfg.dense_part, params["dense_layers"], x_btd, parts[0], start,
                       **(kw | {"router_bias": None, "stack": "dense_layers"}), fp8_history=history.get("dense_layers"))
    rest = run_layers(cfg, params["layers"], first[0], parts[1], start, **kw, first_layer=k,
                      fp8_history=history.get("layers"))
    stats = rest[1] | {"aux": first[1]["aux"] + rest[1]["aux"]}
    if cache is None:
        return rest[0], stats
    return rest[0], stats, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first[2], rest[2])


def compute_weight(w: jax.Array, logical_axes: tuple[str, ...], dtype) -> jax.Array:
    """A stored weight in the compute dtype and layout, cast where it is stored and then gathered
    (FSDP), so the all-gather, and the reduce-scatter of its gradient, move compute-dtype bytes. Cast
    and constrained to the compute layout alone, sharding propagation moved the cast after the gather,
    which then moved float32 (tiny, fsdp=8, bfloat16: every all-gather float32)."""
    if w.dtype == dtype:
        return constrain(w, logical_axes)
    return constrain(stored_weight(w, logical_axes, dtype), logical_axes)


def stored_weight(w: jax.Array, logical_axes: tuple[str, ...], dtype) -> jax.Array:
    """A stored weight in the compute dtype, still as stored: an FP8 matmul quantizes it there, then
    gathers the float8 bytes (shard.models.fp8.gathered)."""
    return constrain(w.astype(dtype), logical_axes, param=True)


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
               router_bias: jax.Array | None = None, first_layer=0, max_logits: bool = False, stack: str = "layers",
               fp8_history: dict | None = None):
    """Scan the layer block over a stack of layers (all of them, or one pipeline stage's slice);
    returns the residual stream and the MoE statistics ({"aux": the summed auxiliary loss; for a MoE
    model also "load" (L, E), the (token, choice) pairs each layer routed to each expert, and "dropped"
    (L,), those its capacity dropped}), and with a KV cache (positions start..) the updated cache as
    well. `zigzag`, `segment_ids`, `positions`, `router_bias`: as in `forward` (given positions are
    already in the zig-zag order, as the batch is). `first_layer`: the index of the stack's first layer
    in the model (a pipeline stage's, traced there), which layers alternating local and global
    attention (cfg.global_every) need. `max_logits` (optimizer.qk_clip): the statistics hold each layer's
    and head's largest attention logit too, "max_logit" (L, N). `stack`: the stack's parameter path
    (`layers`, `dense_layers`, `mtp/layers`), by which the precision rules pick its FP8 matmuls;
    `fp8_history`: the amax histories of its fp8_delayed weights ({weight: {"x", "w", "g"}: (L, H)}, the
    train state's "fp8"), whose gradients are their updates (shard.models.fp8.delayed_einsum)."""
    dtype = compute_dtype(cfg)
    recipes = stack_recipes(stack)
    T = x_btd.shape[1]
    if positions is not None:  # per row: (B, T, H) tables
        rope_at = constrain(positions, (BATCH, LENGTH))
    else:
        rope_at = jnp.asarray(zigzag_positions(T, active_layout().degree(LENGTH)) if zigzag else start + jnp.arange(T))
    cos_th, sin_th = rope_tables(rope_at, cfg)
    window_l, local_rope = _layer_windows(cfg, rope_at, first_layer, jax.tree.leaves(layers)[0].shape[0])
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("packed rows (segment_ids) are for training and evaluation, not a KV cache")
        segment_ids = constrain(segment_ids, (BATCH, LENGTH))
    axes = _layer_axes(cfg, layers)
    gathers = {k: axes[k] for k in stack_gathered(stack, cfg)}  # FP8: quantized as stored, then gathered

    def block(x_btd, xs):
        p, kv, bias_e, window, key, history = xs
        cos, sin = cos_th, sin_th
        if local_rope is not None:
            cos, sin = (jnp.where(window > 0, a, b) for a, b in zip(local_rope, (cos_th, sin_th)))
        window = cfg.sliding_window if window is None else window
        p = _in_compute_layout(p, axes, dtype, gathers)
        if key is not None:
            p["dropout_key"] = key
        record = {} if max_logits and not cfg.mla else None  # (optimizer.qk_clip refuses MLA)
        if cfg.mla:
            attn_btd, kv = mla_block(x_btd, p, cos, sin, cfg, dtype, kv, start, zigzag, segment_ids, window)
        else:
            attn_btd, kv = attention_block(x_btd, p, cos, sin, cfg, dtype, kv, start, zigzag, segment_ids, window,
                                           record, recipes, history, gathers)
        if cfg.sandwich_norms:
            attn_btd = norm(cfg, attn_btd, p["post_attn_norm"])
        x_btd = x_btd + attn_btd
        if cfg.n_experts:
            # generation (a cache) drops no token: a prompt's capacity would differ from each decode step's
            ffn_btd, aux, counts = moe.moe_block(norm(cfg, x_btd, p["mlp_norm"]), p, cfg, dtype,
                                                 dropless=cache is not None, bias_e=bias_e, recipes=recipes)
            stats = {"aux": aux, **counts}
        else:
            ffn_btd, stats = mlp_block(x_btd, p, cfg, dtype, recipes, history, gathers), {"aux": jnp.zeros((), jnp.float32)}
        if record:
            stats["max_logit"] = record["max_logit"]
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
    x_btd, (stats_l, new_cache) = jax.lax.scan(block, x_btd, (layers, cache, router_bias, window_l, keys, fp8_history))
    stats = {**stats_l, "aux": jnp.sum(stats_l["aux"])}
    if "z" in stats:  # a MoE model's router z-loss, summed over layers as the aux loss is
        stats["z"] = jnp.sum(stats_l["z"])
    return (x_btd, stats) if cache is None else (x_btd, stats, new_cache)


def _in_compute_layout(p: dict, axes: dict, dtype, gathers: dict) -> dict:
    """A layer's weights each in its compute layout (FSDP: gathered once, kept for the backward); norm
    scales and the router (its softmax is float32) keep their dtype; FP8 weights in `gathers` stay as
    stored, for their matmul to quantize and then gather (shard.models.fp8.gathered)."""
    return {k: constrain(v, axes[k]) if k.endswith("norm") or k == "router" else
            stored_weight(v, axes[k], dtype) if k in gathers else compute_weight(v, axes[k], dtype) for k, v in p.items()}


def _layer_windows(cfg: ModelConfig, rope_at: jax.Array, first_layer, n_layers: int):
    """Where layers alternate local and global attention (cfg.global_every): each layer's window (0:
    global) and, with rope_local_theta, the local layers' RoPE tables; (None, None) otherwise."""
    if not cfg.windows_vary:
        return None, None
    local_l = (first_layer + jnp.arange(n_layers) + 1) % cfg.global_every != 0
    window_l = jnp.where(local_l, cfg.sliding_window, 0)
    return window_l, rope_tables(rope_at, cfg, local=True) if cfg.rope_local_theta else None


def _layer_axes(cfg: ModelConfig, layers: dict) -> dict[str, tuple]:
    """The logical axes of each weight in `layers` (per layer), which the layer block pins it to under
    the activation rules: the layout it is computed in. For FSDP that is where the weight is gathered
    (once per use), instead of leaving XLA free to move activations to the sharded weight. Weights are
    cast to the compute dtype first, so FSDP gathers (and reduce-scatters gradients) in bf16 on
    accelerators. LoRA adapters take their base weights' axes."""
    axes = {name: p.axes for name, p in layer_params(cfg).items()}
    dense = dense_layer_params(cfg)
    return axes | {name: adapters.adapter_axes(name, dense) for name in layers if adapters.is_adapter(name)}


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
        x_btd, (stats, kv) = block(x_btd, (p, kv, bias, window, None, None))
        aux = aux + stats["aux"]
        new[part].append(kv)
    out = {}
    for part, kvs in new.items():
        for name in ("k", "v"):
            out[name + part] = jnp.stack([kv[name] for kv in kvs]) if kvs else cache[name + part]
    return x_btd, {"aux": aux}, out


def head_logits(cfg: ModelConfig, params: dict, x_btd: jax.Array, table: jax.Array | None = None,
                vocab_split: tuple[str, ...] = ()) -> jax.Array:
    """float32 logits: the matmul accumulates and writes float32 (not bf16 rounded, then cast). Tied:
    through `_table` (`table`, when given). `vocab_split` (untied): mesh axes the logits split the vocab
    over instead of the batch (shard.sharding.queries.head_vocab_split)."""
    dtype = compute_dtype(cfg)
    x_btd = norm(cfg, x_btd, params["final_norm"])
    if cfg.tie_embeddings:
        logits_btv = _logits_einsum("btd,vd->btv", x_btd, table if table is not None else _table(cfg, params))
    elif vocab_split:  # the weight from its stored layout to the vocab split, the tokens gathered over it
        w_dv = constrain(stored_weight(params["unembed"], (EMBED, VOCAB), dtype), (EMBED, VOCAB), drop=vocab_split,
                         onto=VOCAB)
        x_btd = constrain(x_btd, (BATCH, LENGTH, EMBED), drop=vocab_split)
        logits_btv = _logits_einsum("btd,dv->btv", x_btd, w_dv)
    else:
        w_dv = compute_weight(params["unembed"], (EMBED, VOCAB), dtype)
        logits_btv = _logits_einsum("btd,dv->btv", x_btd, w_dv)
    logits_btv = constrain(logits_btv, (BATCH, LENGTH, VOCAB), drop=vocab_split, onto=VOCAB)
    return mask_padded_vocab(cfg, soft_cap(logits_btv, cfg.final_softcap))


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
    if x.dtype == w.dtype and matmuls.rounds_float32(x.dtype):
        return matmuls.einsum_grads(subscripts, x, w, g)
    _, pullback = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), x, w)
    return pullback(g.astype(jnp.result_type(x, w)))


_logits_einsum.defvjp(_logits_einsum_fwd, _logits_einsum_bwd)


CACHE_AXES = (LAYERS, BATCH, LENGTH, KV_HEADS, HEAD_DIM)
# multi-head latent attention's cache (shard.models.mla): the latent and the shared RoPE key per token
LATENT_CACHE_AXES = {"ckv": (LAYERS, BATCH, LENGTH, LATENT), "k_rope": (LAYERS, BATCH, LENGTH, HEAD_DIM)}


def cache_axes(cfg: ModelConfig) -> dict[str, tuple]:
    """The logical axes of each array of `init_cache`'s cache."""
    if cfg.mla:
        return dict(LATENT_CACHE_AXES)
    return dict.fromkeys(("k", "v", "k_local", "v_local"), CACHE_AXES)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache: k and v of shape (L, B, S, K, H) in the compute dtype; S is max_len, or where
    every layer has the same window shorter than that (Mistral), the window: a rolling cache
    (`rolling_cache`) that keeps the last `sliding_window` positions only. Where local and global layers
    alternate (Gemma) and the window is shorter than max_len, the global layers' k and v (max_len) and
    the local layers' "k_local" and "v_local" (the window) are two stacks. With multi-head latent
    attention: "ckv" (L, B, S, kv_lora_rank) and "k_rope" (L, B, S, qk_rope_head_dim), the latent cache."""
    window, dtype = cfg.sliding_window, compute_dtype(cfg)
    if cfg.mla:  # the latent cache: every position, a window masked (shard.models.mla.absorbed_attention)
        return {"ckv": jnp.zeros((cfg.n_layers, batch, max_len, cfg.kv_lora_rank), dtype),
                "k_rope": jnp.zeros((cfg.n_layers, batch, max_len, cfg.qk_rope_head_dim), dtype)}
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
