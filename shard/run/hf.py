"""Hugging Face Llama-family folders (config.json + *.safetensors) to shard's parameters and back.

Each family (FAMILIES: Llama, Qwen2/2.5, Qwen3, Mistral, Mixtral) is a set of config features of the one decoder, read
from config.json's `model_type`; every key of config.json that changes the math is mapped to a model
key or refused by name. Pure conversion: names and layouts only. HF stores projections as (out, in) matrices over flattened
heads; shard keeps (in, heads, head_dim) with a leading `layers` dim. Both use the rotate-half RoPE
layout, so no permutation of q/k is needed.
"""

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from shard.config.train import is_positive_number
from shard.errors import ShardError, first_line
from shard.paths import current_umask
from shard.config.model import ModelConfig

# model_type -> the architecture transformers loads, the features it turns on (ModelConfig fields),
# transformers' defaults for keys a config.json may leave out where they differ from Llama's, the
# bias switches its config reads (Qwen2's q/k/v biases are always there; it reads no switch), and
# whether its sliding window is read (Mistral, Mixtral: always; Qwen: only with use_sliding_window,
# per layer, which shard refuses).
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
}
SUPPORTED_TYPES = tuple(FAMILIES)
_FILE_LIMIT = 4 << 30  # bytes per safetensors file when exporting (HF's default is about 5 GB)


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model folder: one with a config.json."""
    return (Path(path) / "config.json").is_file()


def config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """A ModelConfig for an HF config.json, or a ShardError naming what shard cannot represent."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ShardError(f"model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    rope = hf.get("rope_parameters") or {}  # transformers >= 5; older configs: rope_theta, rope_scaling
    if not isinstance(rope, dict):
        raise ShardError(f"config.json: rope_parameters must be a table, got {rope!r}")
    legacy = hf.get("rope_scaling") or {}  # {"rope_type": "default"} there is plain RoPE too
    kinds = {r.get("rope_type", r.get("type", "default")) for r in (legacy, rope) if isinstance(r, dict)}
    if not isinstance(legacy, dict) or not kinds <= {"default", "llama3"}:
        scaling = legacy or rope
        raise ShardError(f"rope scaling {scaling!r} is not supported; only plain RoPE (rope_type default) and "
                         "Llama 3's (llama3) are")
    family = FAMILIES[kind]
    theta = rope.get("rope_theta", hf.get("rope_theta")) or family["defaults"].get("rope_theta", 10000.0)
    # transformers reads rope_scaling before rope_parameters
    given = legacy or rope
    llama3 = given if given.get("rope_type", given.get("type")) == "llama3" else None
    scaling = {}
    if llama3 is not None:
        keys = {"rope_scaling": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor", "rope_original_context": "original_max_position_embeddings"}
        missing = [v for v in keys.values() if not is_positive_number(llama3.get(v))]
        if missing:
            raise ShardError(f"config.json: llama3 rope scaling needs a positive {missing[0]}, got "
                             f"{llama3.get(missing[0])!r}")
        scaling = {k: float(llama3[v]) for k, v in keys.items()}
        if not scaling["rope_original_context"].is_integer():
            raise ShardError(f"config.json: original_max_position_embeddings must be a whole number, got "
                             f"{llama3['original_max_position_embeddings']!r}")
        scaling["rope_original_context"] = int(scaling["rope_original_context"])
    for flag in family["bias_keys"]:
        if hf.get(flag):
            where = "on the MLP" if flag == "mlp_bias" else "on the attention's output projection"
            raise ShardError(f"{flag}=true is not supported: shard's decoder has no bias {where} ({kind})")
    if not family.get("window") and hf.get("use_sliding_window"):
        raise ShardError(f"use_sliding_window=true is not supported for {kind}: its window applies to the layers "
                         f"from max_window_layers on, and shard's sliding_window is every layer's "
                         f"(sliding_window={hf.get('sliding_window')!r})")
    window = hf.get("sliding_window", family["defaults"].get("sliding_window")) if family.get("window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ShardError(f"config.json: sliding_window must be a positive integer or null (no window), got {window!r}")
    moe = {}
    if kind == "mixtral":
        if hf.get("router_jitter_noise"):
            raise ShardError(f"router_jitter_noise={hf['router_jitter_noise']!r} is not supported: shard's router "
                             "has no jitter noise")
        keys = {"num_local_experts": "n_experts", "num_experts_per_tok": "experts_per_token"}
        for key, field in keys.items():
            value = hf.get(key, family["defaults"][key])
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
            moe[field] = value
        coef = hf.get("router_aux_loss_coef", family["defaults"]["router_aux_loss_coef"])
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
            raise ShardError(f"config.json: router_aux_loss_coef must be a number >= 0, got {coef!r}")
        moe["aux_loss_weight"] = float(coef)
    if hf.get("attention_dropout"):
        raise ShardError(f"attention_dropout={hf['attention_dropout']!r} is not supported: shard has no dropout")
    if hf.get("hidden_act", "silu") != "silu":
        raise ShardError(f"hidden_act {hf['hidden_act']!r} is not supported; only silu (SwiGLU) is")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if hf.get(k) is None]
    if missing:
        raise ShardError(f"config.json lacks {missing[0]!r}")
    sizes = {"vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
             "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": hf["num_attention_heads"],
             "num_key_value_heads": hf.get("num_key_value_heads") or family["defaults"].get("num_key_value_heads")
             or hf["num_attention_heads"],
             "intermediate_size": hf["intermediate_size"],
             "head_dim": hf.get("head_dim") or family["defaults"].get("head_dim")}
    for key, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
    numbers = {"rope_theta": theta, "rms_norm_eps": hf.get("rms_norm_eps") or family["defaults"].get("rms_norm_eps", 1e-6)}
    for key, value in numbers.items():
        if not is_positive_number(value):
            raise ShardError(f"config.json: {key} must be a positive number, got {value!r}")
    heads = sizes["num_attention_heads"]
    cfg = ModelConfig(
        name=name, vocab_size=sizes["vocab_size"], d_model=sizes["hidden_size"],
        n_layers=sizes["num_hidden_layers"], n_heads=heads, n_kv_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"] or sizes["hidden_size"] // heads, mlp_dim=sizes["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(numbers["rope_theta"]), norm_eps=float(numbers["rms_norm_eps"]), **scaling,
        sliding_window=window or 0, **moe, **family["features"],
    )
    problems = cfg.validate()
    if problems:
        raise ShardError(f"config.json describes a model shard can't build: {problems[0]}")
    return cfg


def family_of(cfg: ModelConfig) -> str:
    """The model_type of FAMILIES whose features are cfg's, or a ShardError where no family has them:
    experts make Mixtral, a sliding window alone Mistral, q/k/v biases Qwen2, q/k norms Qwen3."""
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


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json of a model of one of FAMILIES (family_of refuses what none of them holds). A
    mixture of experts becomes Mixtral, which drops no token whatever cfg.moe_routing trained it with."""
    kind = family_of(cfg)
    # Qwen2 has no bias switches (its q/k/v biases are always on); Qwen3 has attention_bias alone
    biases = {"llama": {"attention_bias": False, "mlp_bias": False}}.get(kind, {})
    if kind == "qwen3":
        biases = {"attention_bias": False}
    windows = {"llama": {}, "qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False}}.get(
        kind, {"sliding_window": cfg.sliding_window or None})
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
        "max_position_embeddings": max(4096, cfg.rope_original_context if cfg.rope_scaling else 0),
    } | ({"rope_scaling": _rope_scaling_to_hf(cfg)} if cfg.rope_scaling else {})


def _rope_scaling_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.rope_scaling:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context}


def _layer_map(cfg: ModelConfig):
    """shard layer param -> (HF name template, to_shard(hf_matrix), to_hf(shard_array))."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    family = {}
    if cfg.qkv_bias:
        family |= {f"b{x}": (f"model.layers.{{}}.self_attn.{x}_proj.bias", lambda w, n=n: w.reshape(n, H),
                             lambda w: w.reshape(-1)) for x, n in (("q", N), ("k", K), ("v", K))}
    if cfg.qk_norm:
        family |= {f"{x}_norm": (f"model.layers.{{}}.self_attn.{x}_norm.weight", lambda w: w, lambda w: w)
                   for x in "qk"}
    if cfg.n_experts:  # Mixtral, as its checkpoints store it (transformers 5 fuses w1 and w3 on loading)
        ffn = {"router": ("model.layers.{}.block_sparse_moe.gate.weight", lambda w: w.T, lambda w: w.T)}
        ffn |= {k: (f"model.layers.{{}}.block_sparse_moe.experts.{{e}}.{w}.weight", lambda w: w.T, lambda w: w.T)
                for k, w in (("w_gate", "w1"), ("w_down", "w2"), ("w_up", "w3"))}
    else:
        ffn = {k: (f"model.layers.{{}}.mlp.{k[2:]}_proj.weight", lambda w: w.T, lambda w: w.T)
               for k in ("w_gate", "w_up", "w_down")}
    return family | ffn | {
        "attn_norm": ("model.layers.{}.input_layernorm.weight", lambda w: w, lambda w: w),
        "mlp_norm": ("model.layers.{}.post_attention_layernorm.weight", lambda w: w, lambda w: w),
        "wq": ("model.layers.{}.self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H),
               lambda w: w.reshape(D, N * H).T),
        "wk": ("model.layers.{}.self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H),
               lambda w: w.reshape(D, K * H).T),
        "wv": ("model.layers.{}.self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H),
               lambda w: w.reshape(D, K * H).T),
        "wo": ("model.layers.{}.self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D),
               lambda w: w.reshape(N * H, D).T),
    }


def _names(tmpl: str, layer: int, cfg: ModelConfig) -> list[str]:
    """The HF tensors of one layer's param: one, or one per expert (a template with {e})."""
    if "{e}" in tmpl:
        return [tmpl.format(layer, e=e) for e in range(cfg.n_experts)]
    return [tmpl.format(layer)]


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, V = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {"attn_norm": (D,), "mlp_norm": (D,), "wq": (q, D), "wk": (kv, D), "wv": (kv, D),
                 "wo": (D, q), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F), "bq": (q,), "bk": (kv,),
                 "bv": (kv,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,), "router": (cfg.n_experts, D)}
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for key, (tmpl, _, _) in _layer_map(cfg).items():
        for i in range(cfg.n_layers):
            shapes |= dict.fromkeys(_names(tmpl, i, cfg), per_layer[key])
    return shapes


def params_from_hf(tensors: dict, cfg: ModelConfig, dtype=np.float32) -> dict:
    """shard's parameter tree from HF tensors; a missing tensor or a wrong shape is a ShardError."""
    expected = _expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            raise ShardError(f"the checkpoint lacks tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ShardError(f"tensor {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
        if tensors[name].dtype.kind != "f" and tensors[name].dtype != ml_dtypes.bfloat16:
            raise ShardError(f"tensor {name} is {tensors[name].dtype}; shard imports float weights only "
                             "(quantized checkpoints are not supported)")
        if not np.all(np.isfinite(tensors[name])):
            raise ShardError(f"tensor {name} holds NaN or infinite values")
    # A tied model may still carry lm_head, and older exports carry RoPE's inverse frequencies (recomputed).
    extra = sorted(n for n in set(tensors) - set(expected)
                   if n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ShardError(f"the checkpoint holds tensor {extra[0]}, which the config does not describe "
                         f"({len(extra)} such); check num_hidden_layers and the model type")

    def get(name):
        return np.asarray(tensors[name], dtype=dtype)

    def layer(tmpl, to_shard, i):
        found = [to_shard(get(n)) for n in _names(tmpl, i, cfg)]
        return np.stack(found) if "{e}" in tmpl else found[0]

    layers = {key: np.stack([layer(tmpl, to_shard, i) for i in range(cfg.n_layers)])
              for key, (tmpl, to_shard, _) in _layer_map(cfg).items()}
    params = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"), "layers": layers}
    if not cfg.tie_embeddings:
        params["unembed"] = get("lm_head.weight").T
    return pad_vocab(params, cfg)


def pad_vocab(params: dict, cfg: ModelConfig) -> dict:
    """The embedding (V, D) and unembedding (D, V) tables with zero rows added up to cfg.padded_vocab
    (the tables shard stores); tables already that size are kept as they are."""

    def pad(w, axis):
        short = cfg.padded_vocab - w.shape[axis]
        if short <= 0:
            return w
        widths = [(0, 0)] * w.ndim
        widths[axis] = (0, short)
        return np.pad(np.asarray(w), widths)

    out = dict(params) | {"embed": pad(params["embed"], 0)}
    if "unembed" in params:
        out["unembed"] = pad(params["unembed"], 1)
    return out


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors of shard's parameters, the tables cut back to the true vocabulary (cfg.vocab_size)."""
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": np.ascontiguousarray(np.asarray(params["embed"])[:V]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["unembed"])[:, :V].T)
    for key, (tmpl, _, to_hf) in _layer_map(cfg).items():
        stacked = np.asarray(params["layers"][key])
        for i in range(cfg.n_layers):
            if "{e}" in tmpl:
                out |= {n: np.ascontiguousarray(to_hf(w)) for n, w in zip(_names(tmpl, i, cfg), stacked[i])}
            else:
                out[tmpl.format(i)] = np.ascontiguousarray(to_hf(stacked[i]))
    return out


def read_hf_dir(path: str) -> tuple[dict, dict]:
    """config.json and every tensor of the folder's safetensors files (sharded index or not)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ShardError(f"{path} is not a Hugging Face model folder: no config.json")
    hf_config = read_json(root / "config.json")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ShardError(f"{index} has no weight_map table")
        files = sorted(set(map(str, weight_map.values())))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ShardError(f"{path} holds no .safetensors files")
    tensors: dict = {}
    inside = root.resolve()
    for f in files:
        # the index names files of this folder only: not a path out of it, nor a link that leads out
        if not (root / f).resolve().is_relative_to(inside):
            raise ShardError(f"{index}: the weight_map names {f}, which is outside {path}; a model folder's "
                             "index may name only its own files")
        if not (root / f).is_file():
            raise ShardError(f"{path}: the index names {f}, which is missing")
        try:
            tensors.update(load_file(str(root / f)))
        except SafetensorError as e:
            raise ShardError(f"{root / f} is not a readable safetensors file ({e}); is it truncated?") from None
    return hf_config, tensors


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a one-line ShardError."""
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ShardError(f"{path} must hold a JSON object, not {type(doc).__name__}")
    return doc


def _save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' writer, with its errors (a full disk) as one line, and the file as readable as any
    other this process writes (the writer makes it owner-only)."""
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError
        raise ShardError(f"cannot write {path}: {first_line(e)}") from None
    path.chmod(0o666 & ~current_umask())


# A Hugging Face folder's files that shard's model doesn't hold (token ids, context length, generation
# defaults, the tokenizer): import-hf and train --init-from keep them in the run dir's SIDE_DIR, and
# export-hf writes them back, so a model fine-tuned here stops at its end-of-sequence token there.
SIDE_DIR = "hf"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt",
              "added_tokens.json")
# Keys of the original config.json that would contradict what export-hf writes (float32 weights, no
# quantization, transformers' own Llama code).
# the model's own RoPE is in config_to_hf's keys: an original's llama3 rope_scaling would override them
_NOT_CARRIED = ("dtype", "torch_dtype", "quantization_config", "auto_map", "rope_scaling")


def side_files_of(source: str | Path) -> Path | None:
    """The folder holding the side files of some weights: a Hugging Face folder itself, or the SIDE_DIR
    of a shard checkpoint's run dir; None when there is none."""
    from shard.run.checkpoint import find_checkpoint
    if is_hf_dir(source):
        return Path(source)
    side = find_checkpoint(source)[0].parent / SIDE_DIR
    return side if side.is_dir() else None


def context_note(source: str | Path, seq_len: int) -> str | None:
    """A notice when `seq_len` is beyond the positions the weights at `source` were made for (the
    max_position_embeddings of their config.json: a Hugging Face folder's, or the one a shard checkpoint
    imported from one keeps); None otherwise, or when nothing says."""
    try:
        side = side_files_of(source)
        limit = read_json(side / "config.json").get("max_position_embeddings") if side else None
    except (ShardError, OSError):
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or seq_len <= limit:
        return None
    return (f"data.seq_len {seq_len} is beyond the {limit} positions {source} was made for "
            "(max_position_embeddings in its config.json): the positions past it are new to the model; a longer "
            "context usually comes with a larger model.rope_theta or model.rope_scaling")


def keep_side_files(source: str | Path, run_dir: Path) -> None:
    """Copy the side files of the weights at `source` into run_dir/SIDE_DIR (nothing when it has none)."""
    side = side_files_of(source)
    if side is not None and any((side / name).is_file() for name in SIDE_FILES):
        (run_dir / SIDE_DIR).mkdir(exist_ok=True)
        _copy_side_files(side, run_dir / SIDE_DIR, SIDE_FILES)


def _copy_side_files(side: Path, dest: Path, names: tuple[str, ...]) -> None:
    """Those of `names` that `side` holds, copied into `dest`."""
    for name in names:
        if (side / name).is_file():
            shutil.copyfile(side / name, dest / name)


def write_hf_dir(path: str, cfg: ModelConfig, params: dict, side: Path | None = None) -> list[Path]:
    """config.json + safetensors files (with an index when more than one) that transformers loads; with
    `side` (a folder of SIDE_FILES), the original config's keys that shard's doesn't set and its context
    length, and the tokenizer and generation files."""
    hf_config = config_to_hf(cfg)  # refuses what HF's Llama can't hold before anything is written
    if side is not None and (side / "config.json").is_file():
        original = read_json(side / "config.json")
        hf_config = {k: v for k, v in original.items() if k not in hf_config and k not in _NOT_CARRIED} | hf_config
        if "max_position_embeddings" in original:
            hf_config["max_position_embeddings"] = original["max_position_embeddings"]
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config, indent=1))
    if side is not None:  # config.json is the one just written
        _copy_side_files(side, root, tuple(n for n in SIDE_FILES if n != "config.json"))
    # contiguous copies: safetensors writes raw buffers, so a transposed view would land transposed
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in params_to_hf(params, cfg).items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > _FILE_LIMIT:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    if len(shards) == 1:
        _save_safetensors(shards[0], root / "model.safetensors")
        return [root / "model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        _save_safetensors(shard, root / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(math.prod(t.shape) * 4 for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [root / n for n in names]


# --- LoRA adapters in PEFT's format ----------------------------------------------------------------------

# shard's targets -> the Llama module PEFT adapts (its `target_modules` names and key paths)
PEFT_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def adapters_to_peft(adapters: dict, lora) -> dict[str, np.ndarray]:
    """PEFT's tensors of shard's adapters: per layer and target, lora_A (rank, in features) and lora_B
    (out features, rank), the features flattened as the HF weight's are (heads outer, head_dim inner)."""
    layers = adapters["layers"]
    out = {}
    for target in lora.targets:
        a_lir, b_lro = np.asarray(layers[f"{target}_lora_a"]), np.asarray(layers[f"{target}_lora_b"])
        for i in range(a_lir.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[target]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_lir[i].reshape(-1, lora.rank).T, np.float32)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_lro[i].reshape(lora.rank, -1).T, np.float32)
    return out


def peft_config(lora, base: str = "") -> dict:
    """adapter_config.json of shard's LoRA settings: PEFT's scale is lora_alpha / r, as shard's."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted(PEFT_MODULES[t].split(".")[1] for t in lora.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base or None}


def write_peft_dir(path: str | Path, adapters: dict, lora, base: str = "") -> list[Path]:
    """adapter_config.json + adapter_model.safetensors that peft's PeftModel.from_pretrained loads over
    the base model (`base`: where it is, written into the config)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps(peft_config(lora, base), indent=1))
    _save_safetensors(adapters_to_peft(adapters, lora), root / "adapter_model.safetensors")
    return [root / "adapter_config.json", root / "adapter_model.safetensors"]
