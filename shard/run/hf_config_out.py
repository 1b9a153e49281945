"""shard's ModelConfig to a Hugging Face config.json, by family: the writing half of
shard/run/hf_config.py, which reads config.json and holds the families (FAMILIES).

family_of names the family whose features are a config's; config_to_hf writes the config.json
transformers loads for it (the RoPE scaling table, Gemma's and DeepSeek-V3's keys included).
"""

from shard.config.model import ModelConfig
from shard.errors import ShardError
from shard.run.hf_config import FAMILIES, GEMMA_FEATURES


def family_of(cfg: ModelConfig) -> str:
    """The model_type of FAMILIES whose features are cfg's, or a ShardError where no family has them:
    experts make Mixtral, a sliding window alone Mistral, q/k/v biases Qwen2, q/k norms Qwen3; Gemma's
    norms around each sublayer Gemma 2, or with q/k norms Gemma 3."""
    gemma_features = {f: getattr(cfg, f) for f in GEMMA_FEATURES} | {
        "rope_local_theta": cfg.rope_local_theta, "global_every": cfg.global_every, "attn_softcap": cfg.attn_softcap,
        "final_softcap": cfg.final_softcap, "query_scale": cfg.query_scale}
    if cfg.mla:
        return _deepseek_family(cfg)
    if cfg.mtp_depth:
        raise ShardError(f"model {cfg.name} has multi-token prediction (mtp_depth={cfg.mtp_depth}), whose modules "
                         "no Hugging Face family export-hf writes runs")
    if cfg.dense_layers:
        raise ShardError(f"model {cfg.name} has dense_layers={cfg.dense_layers} without multi-head latent attention, "
                         "which no Hugging Face family export-hf writes has (DeepSeek-V3 has both)")
    if cfg.sandwich_norms:
        kind = "gemma3_text" if cfg.qk_norm else "gemma2"
        wrong = [f"{f}={getattr(cfg, f)!r}" for f, v in GEMMA_FEATURES.items() if getattr(cfg, f) != v]
        wrong += [f"{f}={getattr(cfg, f)!r}" for f in ("qkv_bias", "n_experts") if getattr(cfg, f)]
        if cfg.rope_scaling and (kind != "gemma3_text" or cfg.rope_scaling_type != "linear" or not cfg.rope_local_theta):
            wrong.append(f"rope_scaling={cfg.rope_scaling!r} ({cfg.rope_scaling_type}; Gemma 3 scales its global "
                         "layers' RoPE linearly)")
        if kind == "gemma2" and cfg.rope_local_theta:
            wrong.append(f"rope_local_theta={cfg.rope_local_theta!r}")
        if wrong:
            raise ShardError(f"model {cfg.name} has sandwich_norms with {wrong[0]}, which no Hugging Face family "
                             f"export-hf writes has ({kind} has {', '.join(f'{k}={v!r}' for k, v in GEMMA_FEATURES.items())})")
        return kind
    off = {"norm_plus_one": False, "embed_scale": False, "mlp_activation": "silu", "rope_local_theta": 0.0,
           "global_every": 0, "attn_softcap": 0.0, "final_softcap": 0.0}
    wrong = [f"{f}={gemma_features[f]!r}" for f, v in off.items() if gemma_features[f] != v]
    if cfg.query_scale not in (0.0, cfg.head_dim):
        wrong.append(f"query_scale={cfg.query_scale!r}")
    if wrong:
        raise ShardError(f"model {cfg.name} has {wrong[0]} without Gemma's sandwich_norms, which no Hugging Face "
                         "family export-hf writes has")
    if cfg.n_experts and cfg.qk_norm and not cfg.sliding_window and not cfg.qkv_bias:
        other = [f"{f}={getattr(cfg, f)!r}" for f, v in
                 {"router_scores": "softmax", "routed_scale": 1.0, "n_shared_experts": 0}.items() if getattr(cfg, f) != v]
        if other:
            raise ShardError(f"model {cfg.name} has {other[0]}; Qwen3-MoE's router is a softmax over the experts, "
                             "with no shared experts")
        return "qwen3_moe"
    if cfg.n_experts or cfg.sliding_window:
        kind = "mixtral" if cfg.n_experts else "mistral"
        extra = [f for f in ("qkv_bias", "qk_norm") if getattr(cfg, f)]
        if extra:
            raise ShardError(f"model {cfg.name} has {extra[0]} with {'experts' if cfg.n_experts else 'a sliding window'}"
                             f", which no Hugging Face family export-hf writes has ({kind} has no {extra[0]})")
        router = {"router_scores": "softmax", "router_normalize": True, "routed_scale": 1.0, "n_shared_experts": 0}
        other = [f"{f}={getattr(cfg, f)!r}" for f, v in router.items() if cfg.n_experts and getattr(cfg, f) != v]
        if other:
            raise ShardError(f"model {cfg.name} has {other[0]}; Mixtral's router is a softmax renormalised over the "
                             "chosen experts, with no shared experts (export-hf writes Mixtral folders only)")
        return kind
    for kind, family in FAMILIES.items():
        if all(getattr(cfg, f) == bool(family["features"].get(f)) for f in ("qkv_bias", "qk_norm")):
            return kind
    raise ShardError(f"model {cfg.name} has both qkv_bias and qk_norm, which no Hugging Face family has; export-hf "
                     "writes Llama, Qwen2 (qkv_bias) and Qwen3 (qk_norm) folders")


def _deepseek_family(cfg: ModelConfig) -> str:
    """deepseek_v3 for a model with multi-head latent attention, or a ShardError naming what DeepSeek-V3 lacks."""
    wrong = [f"{f}={getattr(cfg, f)!r}" for f in ("sliding_window", "sandwich_norms", "norm_plus_one",
                                                  "embed_scale", "final_softcap", "query_scale") if getattr(cfg, f)]
    if cfg.mlp_activation != "silu":
        wrong.append(f"mlp_activation={cfg.mlp_activation!r}")
    if cfg.n_experts and cfg.router_scores != "sigmoid":
        wrong.append(f"router_scores={cfg.router_scores!r}")
    if wrong:
        raise ShardError(f"model {cfg.name} has multi-head latent attention with {wrong[0]}, which DeepSeek-V3 "
                         "(the Hugging Face family export-hf writes for it) has not")
    return "deepseek_v3"


def _deepseek_config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json of a DeepSeek-V3 model: experts in every layer after the first dense_layers, or
    (no experts) none."""
    moe = {"first_k_dense_replace": cfg.n_layers, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
           "topk_group": 1, "n_shared_experts": 0, "moe_intermediate_size": cfg.mlp_dim}
    if cfg.n_experts:
        moe = {"first_k_dense_replace": cfg.dense_layers, "n_routed_experts": cfg.n_experts, "num_experts_per_tok":
               cfg.experts_per_token, "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
               "n_shared_experts": cfg.n_shared_experts, "moe_intermediate_size": cfg.mlp_dim,
               "routed_scaling_factor": cfg.routed_scale, "norm_topk_prob": cfg.router_normalize}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "head_dim": cfg.qk_rope_head_dim,
        "intermediate_size": cfg.dense_mlp_dim or cfg.mlp_dim,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": True,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **_rope_scaling_to_hf(cfg)}, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32",
        "max_position_embeddings": _max_positions(cfg), "num_nextn_predict_layers": cfg.mtp_depth, **moe,
    }


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json of a model of one of FAMILIES (family_of refuses what none of them holds). A
    mixture of experts becomes Mixtral, which drops no token whatever cfg.moe_routing trained it with."""
    kind = family_of(cfg)
    if kind == "deepseek_v3":
        return _deepseek_config_to_hf(cfg)
    if FAMILIES[kind].get("gemma"):
        return _gemma_config_to_hf(cfg, kind)
    # Qwen2 has no bias switches (its q/k/v biases are always on); Qwen3 has attention_bias alone
    biases = {"llama": {"attention_bias": False, "mlp_bias": False}}.get(kind, {})
    if kind == "qwen3":
        biases = {"attention_bias": False}
    windows = {"llama": {}, "qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False},
               "qwen3_moe": {"use_sliding_window": False}}.get(kind, {"sliding_window": cfg.sliding_window or None})
    if kind == "qwen3_moe":
        biases = {"attention_bias": False}
        windows |= {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                    "moe_intermediate_size": cfg.mlp_dim, "norm_topk_prob": cfg.router_normalize,
                    "router_aux_loss_coef": cfg.aux_loss_weight, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if kind == "mixtral":
        windows |= {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                    "router_aux_loss_coef": cfg.aux_loss_weight, "router_jitter_noise": 0.0}
    return {
        "architectures": [FAMILIES[kind]["architecture"]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **_rope_scaling_to_hf(cfg)}, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", **biases, **windows, "torch_dtype": "float32",
        "max_position_embeddings": _max_positions(cfg),
    } | ({"rope_scaling": _rope_scaling_to_hf(cfg)} if cfg.rope_scaling else {})


def _max_positions(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: YaRN's scaled context (what its factor extends to)."""
    if cfg.rope_scaling and cfg.rope_scaling_type == "yarn":
        return max(4096, round(cfg.rope_original_context * cfg.rope_scaling))
    return max(4096, cfg.rope_original_context if cfg.rope_scaling else 0)


def _rope_scaling_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.rope_scaling:
        return {"rope_type": "default"}
    if cfg.rope_scaling_type == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_scaling}
    if cfg.rope_scaling_type == "yarn":
        optional = {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
                    "attention_factor": cfg.rope_attention_factor}
        return {"rope_type": "yarn", "factor": cfg.rope_scaling, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "original_max_position_embeddings": cfg.rope_original_context,
                "truncate": cfg.rope_truncate, **{k: v for k, v in optional.items() if v}}
    return {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context}




def _gemma_config_to_hf(cfg: ModelConfig, kind: str) -> dict:
    """The config.json of a Gemma 2 or Gemma 3 text model."""
    types = ["full_attention" if not w else "sliding_attention" for w in cfg.layer_windows()]
    full = {"rope_theta": cfg.rope_theta, **_rope_scaling_to_hf(cfg)}
    rope = full
    if kind == "gemma3_text":
        rope = {"full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
    return {
        "architectures": [FAMILIES[kind]["architecture"]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "rms_norm_eps": cfg.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "torch_dtype": "float32",
        "query_pre_attn_scalar": _whole(cfg.query_scale or cfg.head_dim), "sliding_window": cfg.sliding_window or 4096,
        "layer_types": types, "attn_logit_softcapping": cfg.attn_softcap or None,
        "final_logit_softcapping": cfg.final_softcap or None, "max_position_embeddings": 8192,
    }


def _whole(x: float) -> int | float:
    """x as an int where it is one (transformers' Gemma configs type query_pre_attn_scalar as int)."""
    return int(x) if float(x).is_integer() else x
