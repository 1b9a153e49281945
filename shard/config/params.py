"""The parameter tables: every parameter's shape, logical axes and initial values, one table per kind of
layer, from the model config alone. The model creates its parameters from them and pins each layer
weight to its axes (shard.models.llama); the config lists and counts them from them
(ModelConfig.param_shapes, num_params, matmul_params), and so does the planner. Pure data: no JAX.

Three tables: a dense layer's (the attention, its norms and the gated MLP, with the family features'
parameters), a mixture of experts' (the router, the stacked experts and the shared experts, which take
the MLP's place in a MoE layer), and the model's outside its layers (the embedding, the final norm and
the unembedding). A layer's parameters are listed per layer: the model stores them stacked, with a
leading `layers` dim (`stacked`).

`cfg` is a shard.config.model.ModelConfig throughout, not imported: that module reads these tables.
"""

import dataclasses
from dataclasses import dataclass

from shard.axes import EMBED, EXPERT, HEAD_DIM, HEADS, KV_HEADS, LATENT, LAYERS, MLP, VOCAB


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical axis of each dim (None: a dim no rule splits), and its
    initial values, a truncated normal (within 3 std) of std `init`, zeros where `init` is 0 and ones
    where it is None. `feature`: the ModelConfig switch that adds it ("": every layer of its kind has it)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: float | None
    feature: str = ""


# Axes Muon (optimizer.name = "muon") treats as a batch of matrices: a stacked weight is one matrix per
# layer (and per expert).
MATRIX_BATCH_AXES = (LAYERS, EXPERT)


def muon_matrix(axes: tuple, init) -> bool:
    """Whether Muon orthogonalises a weight with these logical axes and initial values (ParamSpec.init):
    two axes or more besides the batch ones; not the embedding nor the head (a vocab axis), nor norms
    and biases (constant initial values). AdamW trains the others."""
    return sum(a not in MATRIX_BATCH_AXES for a in axes) >= 2 and VOCAB not in axes and bool(init)


# A dense layer's gated MLP, whose place a mixture of experts takes
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")


def _residual_std(cfg) -> float:
    """The scale of the weights that write into the residual stream: down with depth (GPT-2)."""
    return 1.0 / (2 * cfg.n_layers) ** 0.5


def _norm_init(cfg) -> float | None:
    """A norm's weight starts at one, or at zero where the norm scales by (1 + w) (Gemma)."""
    return 0 if cfg.norm_plus_one else None


def dense_layer_params(cfg) -> dict[str, ParamSpec]:
    """A dense layer's parameters, the family features' among them where cfg has them, in the order the
    model creates them (its random draws follow this order)."""
    D, F = cfg.d_model, cfg.mlp_dim
    out_std, one = _residual_std(cfg), _norm_init(cfg)
    attention = mla_params(cfg) if cfg.mla else _gqa_params(cfg)
    table = {"attn_norm": ParamSpec((D,), (EMBED,), one)} | attention | {
        "post_attn_norm": ParamSpec((D,), (EMBED,), one, "sandwich_norms"),
        "mlp_norm": ParamSpec((D,), (EMBED,), one),
        "post_mlp_norm": ParamSpec((D,), (EMBED,), one, "sandwich_norms"),
        "w_gate": ParamSpec((D, F), (EMBED, MLP), D**-0.5),
        "w_up": ParamSpec((D, F), (EMBED, MLP), D**-0.5),
        "w_down": ParamSpec((F, D), (MLP, EMBED), F**-0.5 * out_std),
    }
    return {name: p for name, p in table.items() if not p.feature or getattr(cfg, p.feature)}


def _gqa_params(cfg) -> dict[str, ParamSpec]:
    """Grouped-query attention's parameters, with the family features' (biases, q/k norms)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out_std, one = _residual_std(cfg), _norm_init(cfg)
    return {
        "wq": ParamSpec((D, N, H), (EMBED, HEADS, HEAD_DIM), D**-0.5),
        "wk": ParamSpec((D, K, H), (EMBED, KV_HEADS, HEAD_DIM), D**-0.5),
        "wv": ParamSpec((D, K, H), (EMBED, KV_HEADS, HEAD_DIM), D**-0.5),
        "bq": ParamSpec((N, H), (HEADS, HEAD_DIM), 0, "qkv_bias"),
        "bk": ParamSpec((K, H), (KV_HEADS, HEAD_DIM), 0, "qkv_bias"),
        "bv": ParamSpec((K, H), (KV_HEADS, HEAD_DIM), 0, "qkv_bias"),
        "q_norm": ParamSpec((H,), (HEAD_DIM,), one, "qk_norm"),
        "k_norm": ParamSpec((H,), (HEAD_DIM,), one, "qk_norm"),
        "wo": ParamSpec((N, H, D), (HEADS, HEAD_DIM, EMBED), (N * H) ** -0.5 * out_std),
    }


def mla_params(cfg) -> dict[str, ParamSpec]:
    """Multi-head latent attention's parameters in the attention's place (shard.models.mla), shaped as
    transformers' DeepseekV3 holds them: the query's down-projection to q_lora_rank, its norm and
    up-projection to the heads (or with q_lora_rank 0 one projection, `wq`); one down-projection to the
    key-value latent and the shared RoPE key side by side (`wkv_a`), the latent's norm, one
    up-projection of the latent to each head's key (without RoPE) and value side by side (`wkv_b`); the
    output. The down-projections' latent column is unnamed, like the router's expert column: FSDP
    splits them on embed, and `latent` has its own rule (fsdp for parameters), which would name fsdp
    twice. The latent norms are `feature` "mla": not in a matmul (matmul_params)."""
    D, N, C, Cq = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out_std = _residual_std(cfg)
    if Cq:
        query = {"wq_a": ParamSpec((D, Cq), (EMBED, None), D**-0.5),
                 "q_a_norm": ParamSpec((Cq,), (LATENT,), None, "mla"),
                 "wq_b": ParamSpec((Cq, N, Hn + Hr), (LATENT, HEADS, HEAD_DIM), Cq**-0.5)}
    else:
        query = {"wq": ParamSpec((D, N, Hn + Hr), (EMBED, HEADS, HEAD_DIM), D**-0.5)}
    return query | {
        "wkv_a": ParamSpec((D, C + Hr), (EMBED, None), D**-0.5),
        "kv_a_norm": ParamSpec((C,), (LATENT,), None, "mla"),
        "wkv_b": ParamSpec((C, N, Hn + Hv), (LATENT, HEADS, HEAD_DIM), C**-0.5),
        "wo": ParamSpec((N, Hv, D), (HEADS, HEAD_DIM, EMBED), (N * Hv) ** -0.5 * out_std),
    }


def expert_params(cfg) -> dict[str, ParamSpec]:
    """A mixture of experts' parameters of one layer, in the order the model creates them: the router
    (its expert column unnamed: D x E is too small to split), the E stacked SwiGLU experts and, with
    shared experts, one SwiGLU of n_shared_experts * mlp_dim."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.mlp_dim
    out_std = _residual_std(cfg)
    table = {
        "router": ParamSpec((D, E), (EMBED, None), D**-0.5),
        "w_gate": ParamSpec((E, D, F), (EXPERT, EMBED, MLP), D**-0.5),
        "w_up": ParamSpec((E, D, F), (EXPERT, EMBED, MLP), D**-0.5),
        "w_down": ParamSpec((E, F, D), (EXPERT, MLP, EMBED), F**-0.5 * out_std),
    }
    if cfg.n_shared_experts:
        S = cfg.n_shared_experts * F
        table |= {
            "shared_gate": ParamSpec((D, S), (EMBED, MLP), D**-0.5),
            "shared_up": ParamSpec((D, S), (EMBED, MLP), D**-0.5),
            "shared_down": ParamSpec((S, D), (MLP, EMBED), S**-0.5 * out_std),
        }
    return table


def layer_params(cfg) -> dict[str, ParamSpec]:
    """Every parameter of one layer, in the order the model creates them: the dense layer's, and with
    experts, the dense layer's less its MLP and then the experts'."""
    if not cfg.n_experts:
        return dense_layer_params(cfg)
    dense = {name: p for name, p in dense_layer_params(cfg).items() if name not in MLP_WEIGHTS}
    return dense | expert_params(cfg)


def outer_params(cfg) -> dict[str, ParamSpec]:
    """The model's parameters outside its layers: the embedding table (created before the layers), the
    final norm and, with untied embeddings, the unembedding (after them). Their vocab dim is padded
    (ModelConfig.padded_vocab)."""
    D, V = cfg.d_model, cfg.padded_vocab
    # tied: logits of std ~1 (with embed_scale the looked-up rows are scaled up to std ~1 instead)
    table = {"embed": ParamSpec((V, D), (VOCAB, EMBED), D**-0.5),
             "final_norm": ParamSpec((D,), (EMBED,), _norm_init(cfg))}
    if not cfg.tie_embeddings:
        table["unembed"] = ParamSpec((D, V), (EMBED, VOCAB), D**-0.5)
    return table


def head_params(cfg) -> tuple[str, ...]:
    """The weights a pipeline's last stage runs beside its layers (shard.training.step): the final norm and
    the output projection (the tied table where the embeddings are tied)."""
    return ("final_norm", "embed" if cfg.tie_embeddings else "unembed")


def stacked(p: ParamSpec, n_layers: int) -> ParamSpec:
    """A layer parameter as the model stores it: all layers' in one array, the layer first."""
    return dataclasses.replace(p, shape=(n_layers, *p.shape), axes=(LAYERS, *p.axes))


def model_params(cfg) -> dict[str, ParamSpec]:
    """Every parameter of the model by its path ("embed", "layers/wq", ...), the layers' stacked (the
    dense first layers of a mixture of experts, cfg.dense_layers, in "dense_layers/..." before them).

    Listed in the order the planner sums them in, which is not the order of creation: the embedding; of
    a layer, the parameters every dense layer has (with experts, theirs in the MLP's place), then the
    features', then the router and the shared experts; the final norm and the unembedding. The cost
    model's float sums follow this order, so another would move their last bits."""
    dense = dense_layer_params(cfg)
    layer = {name: p for name, p in dense.items() if not p.feature}
    layer |= {name: p for name, p in dense.items() if p.feature}
    if cfg.n_experts:
        layer |= expert_params(cfg)  # the experts' MLP weights keep the dense ones' places
    outer = outer_params(cfg)
    first = {}
    if cfg.dense_layers:  # DeepSeek-V3's dense first layers, a stack of their own
        first = {f"dense_layers/{name}": stacked(p, cfg.dense_layers)
                 for name, p in dense_layer_params(cfg.dense_part).items()}
    L = cfg.n_layers - cfg.dense_layers
    return ({"embed": outer["embed"]} | first | {f"layers/{name}": stacked(p, L) for name, p in layer.items()}
            | {name: p for name, p in outer.items() if name != "embed"}
            | {f"mtp/{name}": p for name, p in mtp_params(cfg).items()})


def mtp_params(cfg) -> dict[str, ParamSpec]:
    """Multi-token prediction's modules (cfg.mtp_depth, shard.models.mtp), stacked with the module first:
    each one's norms of the previous hidden state and of the embedding, the projection of the two
    side by side back to the residual width, one layer of the main stack's kind ("layers/..."), and its
    own final norm before the shared head. Empty without them."""
    if not cfg.mtp_depth:
        return {}
    D, one = cfg.d_model, _norm_init(cfg)
    module = {"enorm": ParamSpec((D,), (EMBED,), one), "hnorm": ParamSpec((D,), (EMBED,), one),
              "eh_proj": ParamSpec((2 * D, D), (None, EMBED), (2 * D) ** -0.5)}
    module |= {f"layers/{name}": p for name, p in layer_params(cfg).items()}
    module["norm"] = ParamSpec((D,), (EMBED,), one)
    return {name: stacked(p, cfg.mtp_depth) for name, p in module.items()}
