"""Hugging Face config.json to shard's ModelConfig and back, by family.

Each family (FAMILIES: Llama, Qwen2/2.5, Qwen3, Mistral, Mixtral, Gemma 2, Gemma 3) is a set of config
features of the one decoder, read from config.json's `model_type`; every key of config.json that
changes the math is mapped to a model key or refused by name; is_hf_dir and read_json find and read a
folder's config.json. shard/run/hf_config_out.py writes a config.json back; shard/run/hf.py maps the
tensors.
"""

import json
import math
from pathlib import Path

from shard.config.model import ROPE_SCALINGS, ModelConfig
from shard.config.values import is_positive_number
from shard.errors import ShardError

# model_type -> the architecture transformers loads, the features it turns on (ModelConfig fields),
# transformers' defaults for keys a config.json may leave out where they differ from Llama's, the
# bias switches its config reads (Qwen2's q/k/v biases are always there; it reads no switch), and
# whether its sliding window is read (Mistral, Mixtral: always; Qwen: only with use_sliding_window,
# per layer, which shard refuses).
GEMMA_FEATURES = {"norm_plus_one": True, "sandwich_norms": True, "embed_scale": True, "mlp_activation": "gelu_tanh"}
FAMILIES = {
    "llama": {"architecture": "LlamaForCausalLM", "features": {}, "defaults": {},
              "bias_keys": ("attention_bias", "mlp_bias")},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "features": {"qkv_bias": True},
              "defaults": {"num_key_value_heads": 32}, "bias_keys": ()},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "features": {"qk_norm": True},
              "defaults": {"num_key_value_heads": 32, "head_dim": 128}, "bias_keys": ("attention_bias",)},
    "mistral": {"architecture": "MistralForCausalLM", "features": {},
                "defaults": {"num_key_value_heads": 8, "sliding_window": 4096}, "bias_keys": (), "window": True},
    "mixtral": {"architecture": "MixtralForCausalLM", "features": {"moe_routing": "dropless"},
                "defaults": {"num_key_value_heads": 8, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                             "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
                "bias_keys": (), "window": True},
    # Qwen3's sparse models: Qwen3 (q/k norms) with a mixture of experts in every layer, a softmax router
    # renormalised over the chosen experts where norm_topk_prob says so; transformers drops no token
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "features": {"qk_norm": True, "moe_routing": "dropless"},
                  "defaults": {"num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                               "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001, "norm_topk_prob": False},
                  "bias_keys": ("attention_bias",)},
    # Gemma 2 and the text model of Gemma 3: local and global layers by `layer_types` (every 2nd, every
    # 6th global), GeGLU, (1 + w) norms around each sublayer, scaled embeddings, tied tables; Gemma 2
    # soft-caps scores and logits, Gemma 3 normalises q and k and has a RoPE base per layer type.
    "gemma2": {"architecture": "Gemma2ForCausalLM", "features": dict(GEMMA_FEATURES),
               "defaults": {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                            "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                            "final_logit_softcapping": 30.0, "global_every": 2},
               "bias_keys": ("attention_bias",), "window": True, "gemma": True},
    "gemma3_text": {"architecture": "Gemma3ForCausalLM", "features": GEMMA_FEATURES | {"qk_norm": True},
                    "defaults": {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                                 "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                                 "global_every": 6},
                    "bias_keys": ("attention_bias",), "window": True, "gemma": True},
    # DeepSeek-V3 and its descendants (Kimi K2): multi-head latent attention, and experts in every layer from
    # first_k_dense_replace on (model.dense_layers; >= num_hidden_layers: none), sigmoid scores,
    # group-limited, renormalised and scaled, shared experts; transformers drops no token
    "deepseek_v3": {"architecture": "DeepseekV3ForCausalLM", "features": {},
                    "defaults": {"rms_norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512,
                                 "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                 "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                                 "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                                 "norm_topk_prob": True, "first_k_dense_replace": 3},
                    "bias_keys": ("attention_bias",)},
}
SUPPORTED_TYPES = tuple(FAMILIES)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def config_from_hf(hf: dict, name: str = "hf", tensor_names=()) -> ModelConfig:
    """A ModelConfig for an HF config.json, or a ShardError naming what shard cannot represent.
    `tensor_names`: the checkpoint's (DeepSeek-V3's multi-token prediction modules are read where its
    tensors hold them: transformers builds none, so a folder it saves has none)."""
    kind = _model_type(hf)
    family = FAMILIES[kind]
    rope = hf.get("rope_parameters") or {}  # transformers >= 5; older configs: rope_theta, rope_scaling
    if not isinstance(rope, dict):
        raise ShardError(f"config.json: rope_parameters must be a table, got {rope!r}")
    gemma = _gemma_fields(kind, hf, rope) if family.get("gemma") else {}
    theta, scaling = _rope_fields(kind, hf, rope)
    given = hf.get("rope_scaling") or rope
    if kind == "deepseek_v3" and scaling.get("rope_scaling_type", "yarn") != "yarn" and given.get("mscale_all_dim"):
        raise ShardError(f"rope scaling {scaling['rope_scaling_type']} with mscale_all_dim is not supported for "
                         "deepseek_v3: shard scales its attention's softmax by mscale_all_dim with YaRN only")
    _refuse_biases(kind, hf)
    window = _sliding_window(kind, hf)
    if gemma and (not gemma["global_every"] or window is None):  # no layer is windowed
        window, gemma["global_every"] = None, 0
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ShardError(f"config.json: sliding_window must be a positive integer or null (no window), got {window!r}")
    moe = (_mixtral_fields(hf) if kind == "mixtral" else _qwen3_moe_fields(hf) if kind == "qwen3_moe"
           else _deepseek_fields(hf, tensor_names) if kind == "deepseek_v3" else {})
    if hf.get("attention_dropout"):
        raise ShardError(f"attention_dropout={hf['attention_dropout']!r} is not supported: shard has no dropout")
    if not gemma and hf.get("hidden_act", "silu") != "silu":
        raise ShardError(f"hidden_act {hf['hidden_act']!r} is not supported; only silu (SwiGLU) is")
    sizes = _sizes(kind, hf, moe.pop("mlp_dim", None))
    if "head_dim" in moe:  # MLA: the scores' head dim (config.json's head_dim is the RoPE part's)
        sizes["head_dim"] = moe.pop("head_dim")
    numbers = {"rope_theta": theta, "rms_norm_eps": hf.get("rms_norm_eps") or family["defaults"].get("rms_norm_eps", 1e-6)}
    for key, value in numbers.items():
        if not is_positive_number(value):
            raise ShardError(f"config.json: {key} must be a positive number, got {value!r}")
    heads = sizes["num_attention_heads"]
    cfg = ModelConfig(
        name=name, vocab_size=sizes["vocab_size"], d_model=sizes["hidden_size"],
        n_layers=sizes["num_hidden_layers"], n_heads=heads, n_kv_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"] or sizes["hidden_size"] // heads, mlp_dim=sizes["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", bool(gemma))),
        rope_theta=float(numbers["rope_theta"]), norm_eps=float(numbers["rms_norm_eps"]), **scaling,
        sliding_window=window or 0, **moe, **family["features"], **gemma,
    )
    problems = cfg.validate()
    if problems:
        raise ShardError(f"config.json describes a model shard can't build: {problems[0]}")
    return cfg


def _model_type(hf: dict) -> str:
    """config.json's model_type, one of FAMILIES."""
    kind = hf.get("model_type")
    if kind == "gemma3":
        raise ShardError("model_type 'gemma3' is Gemma 3 with its vision tower, which shard does not build; the "
                         "text-only models (gemma-3-1b, model_type gemma3_text) are supported")
    if kind not in SUPPORTED_TYPES:
        raise ShardError(f"model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    return kind


def _rope_fields(kind: str, hf: dict, rope: dict) -> tuple:
    """(RoPE base, the ModelConfig fields of its scaling: {} without it) of a config.json whose
    rope_parameters are `rope`; a scaling other than llama3, yarn and linear is refused."""
    if kind == "gemma3_text" and set(rope) <= set(_LAYER_TYPES) and rope:  # one table per layer type
        rope = rope.get("full_attention") or {}
    legacy = hf.get("rope_scaling") or {}  # {"rope_type": "default"} there is plain RoPE too
    kinds = {r.get("rope_type", r.get("type", "default")) for r in (legacy, rope) if isinstance(r, dict)}
    if not isinstance(legacy, dict) or not kinds <= {"default", *ROPE_SCALINGS}:
        scaling = legacy or rope
        raise ShardError(f"rope scaling {scaling!r} is not supported; only plain RoPE (rope_type default), "
                         "Llama 3's (llama3), YaRN (yarn) and linear are")
    theta = rope.get("rope_theta", hf.get("rope_theta")) or FAMILIES[kind]["defaults"].get("rope_theta", 10000.0)
    # transformers reads rope_scaling before rope_parameters
    given = legacy or rope
    scaling_type = given.get("rope_type", given.get("type", "default"))
    if scaling_type == "default":
        return theta, {}
    return theta, _SCALING_READERS[scaling_type](given, hf)


def _llama3_scaling(llama3: dict, hf: dict) -> dict:
    """The ModelConfig fields of Llama 3's RoPE scaling table."""
    keys = {"rope_scaling": "factor", "rope_low_freq_factor": "low_freq_factor",
            "rope_high_freq_factor": "high_freq_factor", "rope_original_context": "original_max_position_embeddings"}
    missing = [v for v in keys.values() if not is_positive_number(llama3.get(v))]
    if missing:
        raise ShardError(f"config.json: llama3 rope scaling needs a positive {missing[0]}, got "
                         f"{llama3.get(missing[0])!r}")
    scaling = {k: float(llama3[v]) for k, v in keys.items()}
    return scaling | {"rope_original_context": _whole_context(llama3)}


def _whole_context(table: dict) -> int:
    value = table.get("original_max_position_embeddings")
    if not is_positive_number(value) or not float(value).is_integer():
        raise ShardError(f"config.json: original_max_position_embeddings must be a positive whole number, got "
                         f"{value!r}")
    return int(value)


def _yarn_scaling(yarn: dict, hf: dict) -> dict:
    """The ModelConfig fields of a YaRN table (DeepSeek-V3's, Qwen's long-context configs'): transformers'
    keys and defaults, the factor from max_position_embeddings / original_max_position_embeddings where
    the table gives none. partial_rotary_factor is refused where below 1 (shard rotates whole heads)."""
    if yarn.get("partial_rotary_factor", 1.0) != 1.0:
        raise ShardError(f"partial_rotary_factor={yarn['partial_rotary_factor']!r} is not supported: shard's RoPE "
                         "rotates the whole head")
    # transformers: the table's, else config.json's own original_max_position_embeddings, else its
    # max_position_embeddings
    given = yarn.get("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                hf.get("max_position_embeddings")))
    context = _whole_context({"original_max_position_embeddings": given})
    factor = yarn.get("factor")
    if factor is None and is_positive_number(hf.get("max_position_embeddings")):
        factor = hf["max_position_embeddings"] / context
    out = {"rope_scaling_type": "yarn", "rope_original_context": context, "rope_truncate": yarn.get("truncate", True)}
    for key, field, default in (("factor", "rope_scaling", factor), ("beta_fast", "rope_beta_fast", 32.0),
                                ("beta_slow", "rope_beta_slow", 1.0), ("mscale", "rope_mscale", 0.0),
                                ("mscale_all_dim", "rope_mscale_all_dim", 0.0),
                                ("attention_factor", "rope_attention_factor", 0.0)):
        value = default if key == "factor" else yarn.get(key) or default  # transformers: `or` for these
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf or (
                key == "factor" and not value):
            raise ShardError(f"config.json: yarn rope scaling's {key} must be a positive number, got {value!r}")
        out[field] = float(value)
    if not isinstance(out["rope_truncate"], bool):
        raise ShardError(f"config.json: yarn rope scaling's truncate must be true or false, got {out['rope_truncate']!r}")
    return out


def _linear_scaling(linear: dict, hf: dict) -> dict:
    """Linear RoPE scaling (position interpolation: Gemma 3's global layers): every frequency / factor."""
    if not is_positive_number(linear.get("factor")):
        raise ShardError(f"config.json: linear rope scaling needs a positive factor, got {linear.get('factor')!r}")
    return {"rope_scaling_type": "linear", "rope_scaling": float(linear["factor"])}


_SCALING_READERS = {"llama3": _llama3_scaling, "yarn": _yarn_scaling, "linear": _linear_scaling}


def _refuse_biases(kind: str, hf: dict) -> None:
    """The bias switches a family's config reads must be off: shard's decoder has no such bias."""
    for flag in FAMILIES[kind]["bias_keys"]:
        if hf.get(flag):
            where = "on the MLP" if flag == "mlp_bias" else "on the attention's output projection"
            raise ShardError(f"{flag}=true is not supported: shard's decoder has no bias {where} ({kind})")


def _sliding_window(kind: str, hf: dict):
    """The window config.json gives every layer, where its family reads one (None: no window); Qwen's
    window of some layers only is refused."""
    family = FAMILIES[kind]
    if not family.get("window") and hf.get("use_sliding_window"):
        raise ShardError(f"use_sliding_window=true is not supported for {kind}: its window applies to the layers "
                         f"from max_window_layers on, and shard's sliding_window is every layer's "
                         f"(sliding_window={hf.get('sliding_window')!r})")
    return hf.get("sliding_window", family["defaults"].get("sliding_window")) if family.get("window") else None


def _mixtral_fields(hf: dict) -> dict:
    """The mixture-of-experts fields of a Mixtral config.json."""
    defaults = FAMILIES["mixtral"]["defaults"]
    if hf.get("router_jitter_noise"):
        raise ShardError(f"router_jitter_noise={hf['router_jitter_noise']!r} is not supported: shard's router "
                         "has no jitter noise")
    moe = {}
    for key, field in {"num_local_experts": "n_experts", "num_experts_per_tok": "experts_per_token"}.items():
        value = hf.get(key, defaults[key])
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
        moe[field] = value
    coef = hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
        raise ShardError(f"config.json: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    moe["aux_loss_weight"] = float(coef)
    return moe


def _sizes(kind: str, hf: dict, expert_mlp_dim: int | None) -> dict:
    """config.json's sizes by its keys, each a positive integer (head_dim None where it gives none); a
    Qwen3-MoE's intermediate_size is its experts' (`expert_mlp_dim`)."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if hf.get(k) is None]
    if missing:
        raise ShardError(f"config.json lacks {missing[0]!r}")
    defaults = FAMILIES[kind]["defaults"]
    sizes = {"vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
             "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": hf["num_attention_heads"],
             "num_key_value_heads": hf.get("num_key_value_heads") or defaults.get("num_key_value_heads")
             or hf["num_attention_heads"],
             "intermediate_size": hf["intermediate_size"] if expert_mlp_dim is None else expert_mlp_dim,
             "head_dim": hf.get("head_dim") or defaults.get("head_dim")}
    for key, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
    return sizes


def _qwen3_moe_fields(hf: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE config.json (every layer sparse, experts of
    moe_intermediate_size; the dense intermediate_size then sizes nothing)."""
    defaults = FAMILIES["qwen3_moe"]["defaults"]
    sparse_step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if sparse_step != 1 or dense:
        raise ShardError(f"decoder_sparse_step={sparse_step!r} with mlp_only_layers={dense!r} is not supported: "
                         "shard's experts are in every layer (decoder_sparse_step 1, no mlp_only_layers)")
    out = {}
    for key, field in (("num_experts", "n_experts"), ("num_experts_per_tok", "experts_per_token"),
                       ("moe_intermediate_size", "mlp_dim")):
        # transformers 5 writes num_experts as num_local_experts
        value = hf.get(key, hf.get("num_local_experts") if key == "num_experts" else None) or defaults.get(key)
        value = hf.get(key, value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
        out[field] = value
    coef = hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
        raise ShardError(f"config.json: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    return out | {"aux_loss_weight": float(coef), "router_normalize": bool(hf.get("norm_topk_prob", False))}


def _whole_number(hf: dict, key: str, default, zero: bool = False) -> int:
    """A config.json key that must be a positive integer (or 0 with `zero`), or a ShardError."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ShardError(f"config.json: {key} must be a {'whole number' if zero else 'positive integer'}, got {value!r}")
    return value


def _deepseek_fields(hf: dict, tensor_names=()) -> dict:
    """The multi-head latent attention, multi-token prediction and mixture-of-experts fields of a DeepSeek-V3
    config.json: experts in every layer from first_k_dense_replace on (the first ones dense, of
    intermediate_size), or none; num_nextn_predict_layers modules after the layers where the tensors
    (`tensor_names`) hold the first one's projection, none otherwise. Experts choose by a bias
    (e_score_correction_bias) moved at DeepSeek-V3's rate, 0.001, in training."""
    defaults = FAMILIES["deepseek_v3"]["defaults"]
    mtp = _whole_number(hf, "num_nextn_predict_layers", 0, zero=True)
    layers = hf.get("num_hidden_layers")
    mtp = mtp if isinstance(layers, int) and f"model.layers.{layers}.eh_proj.weight" in tensor_names else 0
    if hf.get("rope_interleave", True) is not True:
        raise ShardError("rope_interleave=false is not supported: import-hf reads DeepSeek's RoPE dims in the "
                         "interleaved pairs its checkpoints hold (rope_interleave true)")
    q_lora = hf.get("q_lora_rank", defaults["q_lora_rank"])
    out = {"q_lora_rank": 0 if q_lora is None else _whole_number(hf, "q_lora_rank", q_lora)}
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        out[key] = _whole_number(hf, key, defaults[key])
    out["qk_nope_head_dim"] = _whole_number(hf, "qk_nope_head_dim", defaults["qk_nope_head_dim"], zero=True)
    out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    out |= {"mtp_depth": mtp} if mtp else {}
    dense = _whole_number(hf, "first_k_dense_replace", defaults["first_k_dense_replace"], zero=True)
    if isinstance(layers, int) and dense >= layers:
        return out  # every layer dense, of intermediate_size
    if dense:  # the first layers dense, of intermediate_size
        out |= {"dense_layers": dense, "dense_mlp_dim": _whole_number(hf, "intermediate_size", None)}
    fields = {"n_routed_experts": "n_experts", "num_experts_per_tok": "experts_per_token",
              "moe_intermediate_size": "mlp_dim", "n_group": "router_groups", "topk_group": "router_topk_groups"}
    out |= {field: _whole_number(hf, key, defaults[key]) for key, field in fields.items()}
    out["n_shared_experts"] = _whole_number(hf, "n_shared_experts", defaults["n_shared_experts"], zero=True)
    scale = hf.get("routed_scaling_factor", defaults["routed_scaling_factor"])
    if not is_positive_number(scale):
        raise ShardError(f"config.json: routed_scaling_factor must be a positive number, got {scale!r}")
    return out | {"routed_scale": float(scale), "router_normalize": bool(hf.get("norm_topk_prob", True)),
                  "router_scores": "sigmoid", "moe_routing": "dropless", "aux_loss_weight": 0.0001,
                  "router_bias_update": 0.001}


def _gemma_fields(kind: str, hf: dict, rope: dict) -> dict:
    """The ModelConfig fields of a Gemma 2 or Gemma 3 config.json beyond the common ones: which layers are
    global (`layer_types`), the query scale, soft-caps and, for Gemma 3, the windowed layers' RoPE base."""
    defaults = FAMILIES[kind]["defaults"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ShardError(f"hidden_activation {act!r} is not supported for {kind}; only gelu_pytorch_tanh (GeGLU "
                         "with tanh-approximate GELU) is")
    if hf.get("use_bidirectional_attention"):
        raise ShardError("use_bidirectional_attention=true is not supported: shard's decoder is causal")
    out = {}
    layer_types = hf.get("layer_types")
    n = hf.get("num_hidden_layers")
    every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", defaults["global_every"]))
    if layer_types is not None:
        if not isinstance(layer_types, list) or not set(layer_types) <= set(_LAYER_TYPES) or len(layer_types) != n:
            raise ShardError(f"config.json: layer_types must list sliding_attention or full_attention for each of "
                             f"the {n} layers, got {layer_types!r}")
        fulls = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        every = fulls[0] + 1 if fulls else 0
        pattern = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        if not fulls:
            every = n + 1  # every layer windowed: no global layer in the stack
            pattern = layer_types
        if layer_types != pattern and set(layer_types) != {"full_attention"}:
            raise ShardError(f"config.json: layer_types {layer_types!r} is not every k-th layer global, the one "
                             "pattern shard's model.global_every holds")
        if set(layer_types) == {"full_attention"}:
            every = 0
    out["global_every"] = every if isinstance(every, int) and not isinstance(every, bool) else None
    if out["global_every"] is None or out["global_every"] < 0:
        raise ShardError(f"config.json: sliding_window_pattern must be a whole number of layers, got {every!r}")
    for key, field in (("query_pre_attn_scalar", "query_scale"), ("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "final_softcap")):
        value = hf.get(key, defaults.get(key))
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ShardError(f"config.json: {key} must be a positive number or null, got {value!r}")
        out[field] = float(value or 0.0)
    if kind == "gemma3_text":
        local = hf.get("rope_local_base_freq", defaults["rope_local_base_freq"])
        if set(rope) <= set(_LAYER_TYPES) and rope:
            for layer_type, table in rope.items():
                kind_of = table.get("rope_type", "default") if isinstance(table, dict) else table
                if kind_of != "default" and (layer_type, kind_of) != ("full_attention", "linear"):
                    raise ShardError(f"rope scaling {table!r} of the {layer_type} layers is not supported; only "
                                     "plain RoPE (rope_type default), and linear on the full_attention layers, "
                                     "are for gemma3_text")
            local = (rope.get("sliding_attention") or {}).get("rope_theta", local)
        if not is_positive_number(local):
            raise ShardError(f"config.json: rope_local_base_freq must be a positive number, got {local!r}")
        out["rope_local_theta"] = float(local)
    return out


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model folder: one with a config.json."""
    return (Path(path) / "config.json").is_file()


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a one-line ShardError."""
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ShardError(f"{path} must hold a JSON object, not {type(doc).__name__}")
    return doc
