"""Hugging Face model folders (config.json + *.safetensors) to shard's parameters and back.

The families and their config.json keys are shard/run/hf_config.py's; this module maps the tensors and
reads and writes the folders. The side files a run keeps of a folder (tokenizer, generation defaults)
are shard/run/hf_side.py's; LoRA adapters in PEFT's format, shard/run/hf_peft.py's.
Pure conversion: names and layouts only. HF stores projections as (out, in) matrices over flattened
heads; shard keeps (in, heads, head_dim) with a leading `layers` dim. Both use the rotate-half RoPE
layout, so no permutation of q/k is needed, except for DeepSeek-V3, whose RoPE dims come in interleaved
pairs (rope_interleave): its query's and shared key's RoPE columns are reordered into halves on import
and back on export (`_deinterleave`), which leaves every score as it is.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from shard.errors import ShardError, first_line
from shard.paths import current_umask
from shard.config.model import ModelConfig
from shard.run.hf_config import FAMILIES, SUPPORTED_TYPES, config_from_hf, read_json  # noqa: F401 - the API
from shard.run.hf_config_out import config_to_hf, family_of  # noqa: F401 - the API
from shard.run.hf_side import SIDE_FILES, copy_side_files

_FILE_LIMIT = 4 << 30  # bytes per safetensors file when exporting (HF's default is about 5 GB)


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
    if cfg.n_experts and (cfg.qk_norm or cfg.mla):  # Qwen3-MoE, DeepSeek-V3: per expert as save_pretrained writes it
        ffn = {"router": ("model.layers.{}.mlp.gate.weight", lambda w: w.T, lambda w: w.T)}
        ffn |= {k: (f"model.layers.{{}}.mlp.experts.{{e}}.{k[2:]}_proj.weight", lambda w: w.T, lambda w: w.T)
                for k in ("w_gate", "w_up", "w_down")}
        ffn |= {k: (f"model.layers.{{}}.mlp.shared_experts.{k[7:]}_proj.weight", lambda w: w.T, lambda w: w.T)
                for k in ("shared_gate", "shared_up", "shared_down") if cfg.n_shared_experts}
    elif cfg.n_experts:  # Mixtral, as its checkpoints store it (transformers 5 fuses w1 and w3 on loading)
        ffn = {"router": ("model.layers.{}.block_sparse_moe.gate.weight", lambda w: w.T, lambda w: w.T)}
        ffn |= {k: (f"model.layers.{{}}.block_sparse_moe.experts.{{e}}.{w}.weight", lambda w: w.T, lambda w: w.T)
                for k, w in (("w_gate", "w1"), ("w_down", "w2"), ("w_up", "w3"))}
    else:
        ffn = {k: (f"model.layers.{{}}.mlp.{k[2:]}_proj.weight", lambda w: w.T, lambda w: w.T)
               for k in ("w_gate", "w_up", "w_down")}
    norms = {"mlp_norm": ("model.layers.{}.post_attention_layernorm.weight", lambda w: w, lambda w: w)}
    if cfg.sandwich_norms:  # Gemma: post_attention_layernorm is the norm after attention, not before the MLP
        norms = {k: (f"model.layers.{{}}.{n}.weight", lambda w: w, lambda w: w) for k, n in (
            ("post_attn_norm", "post_attention_layernorm"), ("mlp_norm", "pre_feedforward_layernorm"),
            ("post_mlp_norm", "post_feedforward_layernorm"))}
    attention = _mla_map(cfg) if cfg.mla else {
        "wq": ("model.layers.{}.self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H),
               lambda w: w.reshape(D, N * H).T),
        "wk": ("model.layers.{}.self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H),
               lambda w: w.reshape(D, K * H).T),
        "wv": ("model.layers.{}.self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H),
               lambda w: w.reshape(D, K * H).T),
        "wo": ("model.layers.{}.self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D),
               lambda w: w.reshape(N * H, D).T),
    }
    return family | ffn | norms | attention | {
        "attn_norm": ("model.layers.{}.input_layernorm.weight", lambda w: w, lambda w: w),
    }


def _deinterleave(w, start: int, back: bool = False):
    """w with its last axis's columns from `start` on (RoPE's) reordered from interleaved pairs (x0, x1),
    (x2, x3), ... into halves (x0, x2, ..., x1, x3, ...), the layout shard's RoPE rotates; `back`: the
    inverse. transformers' DeepSeek-V3 (rope_interleave) makes the same reordering of q and k at run time."""
    R = w.shape[-1] - start
    order = np.concatenate([np.arange(start), start + np.arange(0, R, 2), start + np.arange(1, R, 2)])
    return w[..., np.argsort(order) if back else order]


def _mla_map(cfg: ModelConfig):
    """Multi-head latent attention's tensors (DeepSeek-V3): shard param -> (HF name, to_shard, to_hf)."""
    D, N, H, C, Cq = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    attn = "model.layers.{}.self_attn."
    query = {"wq": (attn + "q_proj.weight", lambda w: _deinterleave(w.T.reshape(D, N, H), P),
                    lambda w: _deinterleave(w, P, back=True).reshape(D, N * H).T)}
    if Cq:
        query = {"wq_a": (attn + "q_a_proj.weight", lambda w: w.T, lambda w: w.T),
                 "q_a_norm": (attn + "q_a_layernorm.weight", lambda w: w, lambda w: w),
                 "wq_b": (attn + "q_b_proj.weight", lambda w: _deinterleave(w.T.reshape(Cq, N, H), P),
                          lambda w: _deinterleave(w, P, back=True).reshape(Cq, N * H).T)}
    return query | {
        "wkv_a": (attn + "kv_a_proj_with_mqa.weight", lambda w: _deinterleave(w.T, C),
                  lambda w: _deinterleave(w, C, back=True).T),
        "kv_a_norm": (attn + "kv_a_layernorm.weight", lambda w: w, lambda w: w),
        "wkv_b": (attn + "kv_b_proj.weight", lambda w: w.T.reshape(C, N, P + V), lambda w: w.reshape(C, N * (P + V)).T),
        "wo": (attn + "o_proj.weight", lambda w: w.T.reshape(N, V, D), lambda w: w.reshape(N * V, D).T),
    }


def _names(tmpl: str, layer: int, cfg: ModelConfig) -> list[str]:
    """The HF tensors of one layer's param: one, or one per expert (a template with {e})."""
    if "{e}" in tmpl:
        return [tmpl.format(layer, e=e) for e in range(cfg.n_experts)]
    return [tmpl.format(layer)]


def _mtp_map(cfg: ModelConfig):
    """DeepSeek-V3's multi-token prediction modules, stored as the layers after the last
    (`model.layers.<n_layers + k>.*`): shard param under "mtp" -> (HF name, to_shard, to_hf); the module's
    layer is one of the main stack's kind. The copies of the embedding and head those layers also hold
    (embed_tokens, shared_head.head) are the decoder's, shared (_MTP_SHARED)."""
    same = (lambda w: w, lambda w: w)
    module = {"enorm": ("model.layers.{}.enorm.weight", *same), "hnorm": ("model.layers.{}.hnorm.weight", *same),
              "eh_proj": ("model.layers.{}.eh_proj.weight", lambda w: w.T, lambda w: w.T),
              "norm": ("model.layers.{}.shared_head.norm.weight", *same)}
    return module | {f"layers/{k}": v for k, v in _layer_map(cfg).items()}


_MTP_SHARED = {"model.layers.{}.embed_tokens.weight": "model.embed_tokens.weight",
               "model.layers.{}.shared_head.head.weight": "lm_head.weight"}


def _stacks(cfg: ModelConfig) -> list[tuple[str, ModelConfig, range, dict]]:
    """(params key, the stack's config, its HF layer numbers, its tensor map) of each layer stack:
    "layers", before it the dense first layers' "dense_layers" (cfg.dense_layers, DeepSeek-V3's
    first_k_dense_replace), after it the multi-token prediction modules' "mtp" (cfg.mtp_depth)."""
    k, L = cfg.dense_layers, cfg.n_layers
    stacks = [("dense_layers", cfg.dense_part, range(k), _layer_map(cfg.dense_part))] if k else []
    stacks.append(("layers", cfg, range(k, L), _layer_map(cfg)))
    if cfg.mtp_depth:
        stacks.append(("mtp", cfg, range(L, L + cfg.mtp_depth), _mtp_map(cfg)))
    return stacks


def _stack_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor shape of each key of a stack's tensor map (per layer, per expert)."""
    D = cfg.d_model
    layer = _layer_shapes(cfg)
    return layer | {f"layers/{k}": v for k, v in layer.items()} | {
        "enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D), "norm": (D,)}


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a model of `cfg` is made of: name -> shape."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model), "model.norm.weight": (cfg.d_model,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    for _, c, numbers, tensors in _stacks(cfg):
        per_layer = _stack_shapes(c)
        for key, (tmpl, _, _) in tensors.items():
            for i in numbers:
                shapes |= dict.fromkeys(_names(tmpl, i, c), per_layer[key])
    return shapes


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor shape of each shard layer param of `cfg` (per layer, per expert)."""
    D, F = cfg.d_model, cfg.mlp_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {"attn_norm": (D,), "mlp_norm": (D,), "post_attn_norm": (D,), "post_mlp_norm": (D,), "wq": (q, D),
                 "wk": (kv, D), "wv": (kv, D), "wo": (D, q), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F),
                 "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
                 "router": (cfg.n_experts, D)}
    if cfg.mla:
        S, C, R = cfg.n_shared_experts * F, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        per_layer |= {"wq_a": (cfg.q_lora_rank, D), "q_a_norm": (cfg.q_lora_rank,), "wq_b": (q, cfg.q_lora_rank),
                      "wkv_a": (C + R, D), "kv_a_norm": (C,), "wo": (D, cfg.n_heads * cfg.v_head_dim),
                      "wkv_b": (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), C),
                      "shared_gate": (S, D), "shared_up": (S, D), "shared_down": (D, S)}
    return per_layer


def params_from_hf(tensors, cfg: ModelConfig, dtype=np.float32) -> dict:
    """shard's parameter tree (numpy) from HF tensors (a dict, or a folder's HFTensors); a missing tensor or
    a wrong shape is a ShardError."""
    import jax

    return jax.tree.map(np.asarray, lazy_params_from_hf(tensors, cfg, dtype))


class LazyParam:
    """One of shard's parameters as HF tensors make it, read block by block when asked: `read(index)`
    (a tuple of slices, one per dim, as jax.make_array_from_callback hands a device its shard) reads only
    the HF tensors that block takes (a layer's, an expert's), one at a time, so placing a model into its
    shardings holds one tensor beyond the shards (shard.run.weights.place). np.asarray reads it whole.
    `tensor_dims`: how many leading dims pick an HF tensor (a layer-stacked param 1, an expert-stacked
    one 2, a table 0): `place` puts such a param one HF tensor at a time."""

    def __init__(self, shape: tuple[int, ...], dtype, read, tensor_dims: int = 0):
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(dtype), read
        self.tensor_dims = tensor_dims
        self._last = None  # (index, block): devices holding the same block (replicas) read it once

    def read(self, index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if self._last is None or self._last[0] != key:
            self._last = (key, np.asarray(self._read(index), self.dtype))
        return self._last[1]

    def forget(self) -> None:
        self._last = None

    def __getitem__(self, index):
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        whole = np.asarray(self._read(tuple(slice(None) for _ in self.shape)), self.dtype)
        return whole if dtype is None else whole.astype(dtype)


def lazy_params_from_hf(tensors, cfg: ModelConfig, dtype=np.float32) -> dict:
    """shard's parameter tree of LazyParams over HF tensors (a dict, or a folder's HFTensors), after
    checking every tensor's name, shape and dtype (from the files' headers: nothing is read); a tensor
    holding NaN or infinite values is refused when it is read."""
    expected = expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            raise ShardError(f"the checkpoint lacks tensor {name}")
        if _shape(tensors, name) != shape:
            raise ShardError(f"tensor {name} has shape {_shape(tensors, name)}, the config implies {shape}")
        kind = _dtype(tensors, name)
        if kind.kind != "f" and kind != ml_dtypes.bfloat16:
            raise ShardError(f"tensor {name} is {kind}; shard imports float weights only "
                             "(quantized checkpoints are not supported)")
    # A tied model may still carry lm_head, and older exports carry RoPE's inverse frequencies (recomputed).
    shared = {t.format(cfg.n_layers + k): main for t, main in _MTP_SHARED.items() for k in range(cfg.mtp_depth)}
    extra = sorted(n for n in set(tensors) - set(expected) - set(shared)
                   if n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq") and not n.endswith(_EXPERT_BIAS))
    router_bias_from_hf(tensors, cfg)  # checked here, read by weights.load_with_router_bias
    if extra:
        raise ShardError(f"the checkpoint holds tensor {extra[0]}, which the config does not describe "
                         f"({len(extra)} such); check num_hidden_layers and the model type")
    for name in sorted(set(shared) & set(tensors)):  # read whole: a copy that differs would be lost
        main = shared[name] if shared[name] in tensors else "model.embed_tokens.weight"
        if _shape(tensors, name) != _shape(tensors, main) or not np.array_equal(tensors[name], tensors[main]):
            raise ShardError(f"tensor {name} differs from {main}: shard's multi-token prediction modules share "
                             "the decoder's embedding and output head")

    def get(name):
        t = np.asarray(tensors[name], dtype=dtype)
        if not np.all(np.isfinite(t)):
            raise ShardError(f"tensor {name} holds NaN or infinite values")
        return t

    def stacked(tmpl, to_shard, shape, numbers):
        def read(index):
            layer_index, rest = index[0], index[1:]
            if "{e}" in tmpl:  # one tensor per expert: read only the experts this block holds
                return np.stack([np.stack([to_shard(get(n))[rest[1:]] for n in _names(tmpl, i, cfg)[rest[0]]])
                                 for i in numbers[layer_index]])
            return np.stack([to_shard(get(tmpl.format(i)))[rest] for i in numbers[layer_index]])
        return LazyParam((len(numbers), *shape), dtype, read, tensor_dims=2 if "{e}" in tmpl else 1)

    def table(name, transpose: bool):  # (V, D) stored, padded to cfg.padded_vocab rows (columns transposed)
        V, Vp, D = cfg.vocab_size, cfg.padded_vocab, cfg.d_model

        def read(index):
            rows, cols = (index[1], index[0]) if transpose else index
            r = range(Vp)[rows]
            block = np.zeros((len(r), len(range(D)[cols])), dtype)
            real = range(r.start, min(r.stop, V), r.step) if r.step > 0 else r
            if len(real):
                block[: len(real)] = get(name)[real.start:real.stop:real.step, cols]
            return block.T if transpose else block
        return LazyParam((D, Vp) if transpose else (Vp, D), dtype, read)

    final = LazyParam((cfg.d_model,), dtype, lambda index: get("model.norm.weight")[index])
    params = {"embed": table("model.embed_tokens.weight", False), "final_norm": final}
    for stack, _, numbers, layer_tensors in _stacks(cfg):
        shapes = {p.split("/", 1)[1]: s[1:] for p, s, _ in cfg.param_shapes() if p.startswith(stack + "/")}
        params[stack] = _nested({key: stacked(tmpl, to_shard, shapes[key], numbers)
                                 for key, (tmpl, to_shard, _) in layer_tensors.items()})
    if not cfg.tie_embeddings:
        params["unembed"] = table("lm_head.weight", True)
    return params


def _nested(flat: dict) -> dict:
    """{"a/b": x} -> {"a": {"b": x}}."""
    out: dict = {}
    for key, value in flat.items():
        *outer, last = key.split("/")
        node = out
        for k in outer:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def _at(tree: dict, key: str):
    for k in key.split("/"):
        tree = tree[k]
    return tree


# DeepSeek-V3's per-expert bias experts are chosen by (auxiliary-loss-free balancing): shard keeps it in the
# train state (model.router_bias_update), not among the parameters
_EXPERT_BIAS = ".mlp.gate.e_score_correction_bias"


def _bias_names(cfg: ModelConfig) -> list[str]:
    """The expert-choice bias tensor of each router bias row: the layers with experts', then the MTP
    modules' layers' (model.layers.<n_layers + k>)."""
    if not cfg.n_experts:
        return []
    return [f"model.layers.{i}{_EXPERT_BIAS}" for i in range(cfg.dense_layers, cfg.n_layers + cfg.mtp_depth)]


def router_bias_from_hf(tensors, cfg: ModelConfig) -> np.ndarray | None:
    """The expert-choice bias (DeepSeek's auxiliary-loss-free balancing, e_score_correction_bias) of the
    layers with experts and then of the MTP modules' layers, (router_bias_layers, E) float32, as shard's
    train state holds it; None where the checkpoint holds none. A bias of the wrong shape, or one where
    shard has no such layer, is a ShardError."""
    names = {n for n in tensors if n.endswith(_EXPERT_BIAS)}
    if not names:
        return None
    moe = _bias_names(cfg)
    for name in sorted(names):
        if name not in moe:
            raise ShardError(f"the checkpoint holds tensor {name}, which the config does not describe")
        if _shape(tensors, name) != (cfg.n_experts,):
            raise ShardError(f"tensor {name} has shape {_shape(tensors, name)}, the config implies ({cfg.n_experts},)")
    bias = np.stack([np.asarray(tensors[n], np.float32) if n in names else np.zeros(cfg.n_experts, np.float32)
                     for n in moe])
    if not np.all(np.isfinite(bias)):
        raise ShardError("the checkpoint's e_score_correction_bias holds NaN or infinite values")
    return bias




def _shape(tensors, name: str) -> tuple[int, ...]:
    return tensors.shape(name) if isinstance(tensors, HFTensors) else tuple(tensors[name].shape)


def _dtype(tensors, name: str) -> np.dtype:
    return tensors.dtype(name) if isinstance(tensors, HFTensors) else np.dtype(tensors[name].dtype)


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


def params_to_hf(params: dict, cfg: ModelConfig, router_bias=None) -> dict[str, np.ndarray]:
    """HF tensors of shard's parameters, the tables cut back to the true vocabulary (cfg.vocab_size); a
    DeepSeek-V3 mixture of experts with its expert-choice bias, `router_bias` (the layers with experts,
    then the MTP modules', E) (zeros where None)."""
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": np.ascontiguousarray(np.asarray(params["embed"])[:V]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["unembed"])[:, :V].T)
    for stack, c, numbers, layer_tensors in _stacks(cfg):
        for key, (tmpl, _, to_hf) in layer_tensors.items():
            stacked = np.asarray(_at(params[stack], key))
            for j, i in enumerate(numbers):
                if "{e}" in tmpl:
                    out |= {n: np.ascontiguousarray(to_hf(w)) for n, w in zip(_names(tmpl, i, c), stacked[j])}
                else:
                    out[tmpl.format(i)] = np.ascontiguousarray(to_hf(stacked[j]))
    if cfg.mla and cfg.n_experts:
        names = _bias_names(cfg)
        bias = np.zeros((len(names), cfg.n_experts), np.float32) if router_bias is None else np.asarray(router_bias)
        out |= {name: np.ascontiguousarray(bias[j], np.float32) for j, name in enumerate(names)}
    for tmpl, main in _MTP_SHARED.items():  # DeepSeek's MTP layers hold copies of the shared embedding and head
        out |= {tmpl.format(i): out.get(main, out["model.embed_tokens.weight"])
                for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)}
    return out


def read_hf_dir(path: str) -> tuple[dict, "HFTensors"]:
    """config.json and the tensors of the folder's safetensors files (sharded index or not), as HFTensors:
    the files' headers are read (names, shapes, dtypes), each tensor only when asked for."""
    from safetensors import SafetensorError, safe_open

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
    where: dict[str, Path] = {}
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    inside = root.resolve()
    for f in files:
        # the index names files of this folder only: not a path out of it, nor a link that leads out
        if not (root / f).resolve().is_relative_to(inside):
            raise ShardError(f"{index}: the weight_map names {f}, which is outside {path}; a model folder's "
                             "index may name only its own files")
        if not (root / f).is_file():
            raise ShardError(f"{path}: the index names {f}, which is missing")
        try:
            with safe_open(str(root / f), "numpy") as opened:
                for name in opened.keys():  # noqa: SIM118 - safe_open is not iterable
                    piece = opened.get_slice(name)
                    where[name], header[name] = root / f, (tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as e:
            raise ShardError(f"{root / f} is not a readable safetensors file ({first_line(e)}); is it "
                             "truncated?") from None
    return hf_config, HFTensors(where, header)


class HFTensors(Mapping):
    """The tensors of a model folder's safetensors files by name, each read from its file (memory-mapped)
    when asked for; shapes and dtypes come from the files' headers without reading any tensor."""

    _DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
               "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}

    def __init__(self, where: dict[str, Path], header: dict[str, tuple[tuple[int, ...], str]]):
        self._where, self._header = where, header

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import SafetensorError, safe_open

        path = self._where[name]
        try:
            with safe_open(str(path), "numpy") as opened:
                return opened.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ShardError(f"{path}: tensor {name} cannot be read ({first_line(e)}); is the file truncated?") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header[name][0]

    def dtype(self, name: str) -> np.dtype:
        kind = self._header[name][1]
        return np.dtype(self._DTYPES[kind]) if kind in self._DTYPES else np.dtype("V1")  # V: not a float


def save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' writer, with its errors (a full disk) as one line, and the file as readable as any
    other this process writes (the writer makes it owner-only)."""
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError
        raise ShardError(f"cannot write {path}: {first_line(e)}") from None
    path.chmod(0o666 & ~current_umask())


# Keys of the original config.json that would contradict what export-hf writes (float32 weights, no
# quantization, transformers' own Llama code).
# the model's own RoPE is in config_to_hf's keys: an original's llama3 rope_scaling would override them
_NOT_CARRIED = ("dtype", "torch_dtype", "quantization_config", "auto_map", "rope_scaling")


def write_hf_dir(path: str, cfg: ModelConfig, params: dict, side: Path | None = None,
                 router_bias=None) -> list[Path]:
    """config.json + safetensors files (with an index when more than one) that transformers loads; with
    `side` (a folder of SIDE_FILES), the original config's keys that shard's doesn't set and its context
    length, and the tokenizer and generation files. `router_bias`: as in params_to_hf."""
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
        copy_side_files(side, root, tuple(n for n in SIDE_FILES if n != "config.json"))
    # contiguous copies: safetensors writes raw buffers, so a transposed view would land transposed
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in params_to_hf(params, cfg, router_bias).items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > _FILE_LIMIT:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_safetensors(shards[0], root / "model.safetensors")
        return [root / "model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_safetensors(shard, root / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(math.prod(t.shape) * 4 for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [root / n for n in names]
