"""Model families (Qwen2/2.5: qkv_bias, Qwen3: qk_norm, Mistral: sliding_window, Mixtral: experts, Gemma 2
and 3: local and global layers, soft-caps, (1 + w) sandwich norms, GeGLU) against transformers' own code: a random tiny
model of each, built offline with its config class, imports with equal logits on one device and on a
sharded mesh, generates the same 32 greedy tokens, and exports back to identical tensors; what shard
cannot represent is refused in one line; parameter counts equal transformers'. Skipped where
torch/transformers are absent (the `hf` extra)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from shard.config.presets import PRESETS  # noqa: E402
from shard.errors import ShardError  # noqa: E402
from shard.models import llama  # noqa: E402
from shard.run import hf  # noqa: E402
from shard.sharding.layout import make_layout  # noqa: E402
from shard.sharding.mesh import parse_mesh  # noqa: E402
from shard.sharding.rules import activation_layout  # noqa: E402
from shard.testing import devices_for, tiny_config  # noqa: E402
from shard.training.generate import Generator, Sampling  # noqa: E402
from shard.training.state import state_spec  # noqa: E402

CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
                  "mixtral": "MixtralConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
                  "qwen3_moe": "Qwen3MoeConfig"}
# Gemma: a local and a global layer, each with its own RoPE base (Gemma 3), a query scale that is not
# head_dim's, and (Gemma 2) caps low enough that the logits and scores reach them
_GEMMA_KEYS = {"sliding_window": 6, "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"],
               "eos_token_id": None}  # (Gemma 3 defaults to 1: generate would stop there)
# Mistral's window (6) is shorter than the 16 tokens compared and the 40 generated; Mixtral: 8 experts,
# top 2, and a window too
FAMILY_KEYS = {"mistral": {"sliding_window": 6},
               "mixtral": {"sliding_window": 6, "num_local_experts": 8, "num_experts_per_tok": 2},
               "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "norm_topk_prob": True},
               "gemma2": _GEMMA_KEYS | {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0},
               "gemma3_text": _GEMMA_KEYS | {"rope_parameters": {
                   "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}}
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 16)).tolist()
SHARDED = "fsdp=2,model=4"


@pytest.fixture(scope="module", params=list(CONFIG_CLASSES))
def family(request, tmp_path_factory):
    """(transformers model, its folder, shard's config, shard's params) for a random tiny model whose
    head_dim is its own (16 heads x 8 != 64), with GQA, untied embeddings and larger than default
    weights (std 0.2: logits of order 1, not 0.01), biases and norm scales random too."""
    cls = getattr(transformers, CONFIG_CLASSES[request.param])
    rope = {} if request.param == "gemma3_text" else {"rope_theta": 1e6}
    cfg = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=8, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.2, max_position_embeddings=512, **rope, **FAMILY_KEYS.get(request.param, {}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    config_json, tensors = hf.read_hf_dir(str(path))
    ours = dataclasses.replace(hf.config_from_hf(config_json), compute_dtype="float32")
    return model, path, ours, hf.params_from_hf(tensors, ours)


def _layout(mesh: str, **sets):
    tc = tiny_config(mesh, **sets)
    return tc, make_layout(tc, parse_mesh(mesh), devices_for(mesh))


def _logits(cfg, params, mesh: str, tokens=TOKENS, **sets):
    tc, layout = _layout(mesh, **sets)
    spec = state_spec(cfg, tc.optimizer, 3, layout)

    def f(p, tokens):
        with activation_layout(layout):
            return llama.forward(cfg, p, tokens)[0]

    return np.asarray(jax.jit(f)(jax.device_put(params, spec.shardings["params"]), jnp.asarray(tokens)))


def test_the_family_comes_from_model_type(family):
    model, _, cfg, params = family
    kind = model.config.model_type
    assert (cfg.qkv_bias, cfg.qk_norm) == {"qwen2": (True, False), "qwen3": (False, True),
                                           "gemma3_text": (False, True), "qwen3_moe": (False, True)}.get(kind, (False, False))
    assert cfg.layer_windows() == ([6, 0] if kind.startswith("gemma") else [cfg.sliding_window] * 2)
    assert (cfg.attn_softcap, cfg.final_softcap) == ((3.0, 2.0) if kind == "gemma2" else (0.0, 0.0))
    assert cfg.rope_local_theta == (100.0 if kind == "gemma3_text" else 0.0)
    assert cfg.sliding_window == (6 if "sliding_window" in FAMILY_KEYS.get(kind, {}) else 0)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_routing) == ((8, 2, "dropless") if kind in ("mixtral", "qwen3_moe")
                                                                       else (0, 2, "dropless"))
    assert (cfg.head_dim, cfg.n_heads * cfg.head_dim) == (8, 128) and cfg.d_model == 64
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mesh, sets", [("1x1", {}), (SHARDED, {}), (SHARDED, {"rules__kv_heads": "none"})],
                         ids=["one-device", "fsdp2-model4", "fsdp2-model4-kv-replicated"])
def test_logits_match_transformers(family, mesh, sets):
    """On one device, and sharded: heads split alike (q, k, v in one einsum, biases grouped with their
    weights) and kv heads replicated while heads are split (three einsums)."""
    model, _, cfg, params = family
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    ours = _logits(cfg, params, mesh, **sets)
    assert np.abs(theirs).max() > 1  # the comparison is not of near-zero numbers
    print(f"{model.config.model_type} {mesh} {sets}: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-5)


def test_the_window_matters(family):
    """The window is shorter than the tokens compared: without it the logits differ."""
    model, _, cfg, params = family
    if not cfg.sliding_window:
        pytest.skip("no window")
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    unwindowed = _logits(dataclasses.replace(cfg, sliding_window=0), params, "1x1")
    assert np.abs(unwindowed - theirs)[:, cfg.sliding_window:].max() > 1e-2


def test_mixtral_logits_match_transformers_with_experts_split(family):
    """Expert parallel: the ep layout splits the experts over a mesh axis (dropless routing gathers them
    at its per-device boundary)."""
    model, _, cfg, params = family
    if not cfg.n_experts:
        pytest.skip("dense")
    tokens = np.random.default_rng(1).integers(0, 256, (8, 16))  # ep splits the batch over data x expert (8)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = _logits(cfg, params, "ep", tokens=tokens)
    print(f"mixtral ep: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-5)


def test_greedy_tokens_match_transformers_on_a_sharded_mesh(family):
    model, _, cfg, params = family
    prompt = TOKENS[0][:8]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tc, layout = _layout(SHARDED)
    spec = state_spec(cfg, tc.optimizer, 3, layout)
    gen = Generator(cfg, spec.graphdef, jax.device_put(params, spec.shardings["params"]), layout, max_len=48)
    tokens = gen.generate(prompt, 32, Sampling(temperature=0))
    assert tokens == theirs[0, len(prompt):].tolist()
    assert len(set(tokens)) > 4  # not one token repeated


def test_export_reloads_in_transformers_with_identical_tensors(family, tmp_path):
    model, path, cfg, params = family
    hf.write_hf_dir(str(tmp_path), cfg, params, side=path)
    written = json.loads((tmp_path / "config.json").read_text())
    kind = model.config.model_type
    assert written["model_type"] == kind and written["architectures"] == [hf.FAMILIES[kind]["architecture"]]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is type(model)
    ref = model.state_dict()
    assert again.state_dict().keys() == ref.keys()
    for name, t in again.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("kind, change, message", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096},
     r"use_sliding_window=true is not supported for qwen2: its window applies to the layers from "
     r"max_window_layers on, and shard's sliding_window is every layer's \(sliding_window=4096\)"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ("qwen3", {"attention_bias": True},
     "attention_bias=true is not supported: shard's decoder has no bias on the attention's output projection"),
    ("qwen2", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported: shard has no dropout"),
    ("qwen2", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope scaling .* is not supported"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer or null"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported: shard's router has no "
                                              "jitter noise"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be a positive integer, got 0"),
    ("mixtral", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
], ids=["qwen2-window", "qwen3-window", "qwen3-output-bias", "dropout", "longrope", "gelu", "mistral-window-0",
        "mixtral-jitter", "mixtral-no-experts", "mixtral-dropout"])
def test_what_shard_cannot_represent_is_refused_in_one_line(kind, change, message):
    base = hf.config_to_hf(PRESETS[f"{kind}-tiny"])
    with pytest.raises(ShardError, match=message) as e:
        hf.config_from_hf(base | change)
    assert "\n" not in str(e.value)


def test_what_transformers_ignores_is_read_as_it_reads_it():
    """A window that use_sliding_window leaves off (Qwen2.5's configs carry one) is no window; Qwen2 reads
    no attention_bias (its q/k/v biases are always on); Qwen3's head_dim defaults to 128, not
    hidden_size / heads; both families' kv heads default to 32."""
    qwen2 = hf.config_to_hf(PRESETS["qwen2-tiny"])
    off = {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21, "attention_bias": False}
    assert hf.config_from_hf(qwen2 | off) == hf.config_from_hf(qwen2)
    qwen3 = {k: v for k, v in hf.config_to_hf(PRESETS["qwen3-tiny"]).items()
             if k not in ("head_dim", "num_key_value_heads")}
    cfg = hf.config_from_hf(qwen3 | {"num_attention_heads": 32})
    assert (cfg.head_dim, cfg.n_kv_heads) == (128, 32)
    both = dataclasses.replace(PRESETS["qwen3-tiny"], qkv_bias=True)
    with pytest.raises(ShardError, match="has both qkv_bias and qk_norm, which no Hugging Face family has"):
        hf.config_to_hf(both)


def test_mistral_and_mixtral_read_as_transformers_reads_them():
    """Mistral's window defaults to 4096 when the key is absent, null is no window; Mixtral's defaults
    (rope_theta 1e6, rms_norm_eps 1e-5, 8 experts, top 2) apply; a window with Qwen's features, and a
    router Mixtral has not, are not exported."""
    mistral = hf.config_to_hf(PRESETS["mistral-tiny"])
    assert (mistral["model_type"], mistral["sliding_window"]) == ("mistral", 8)
    assert hf.config_from_hf({k: v for k, v in mistral.items() if k != "sliding_window"}).sliding_window == 4096
    assert hf.config_from_hf(mistral | {"sliding_window": None}).sliding_window == 0
    assert hf.config_from_hf(mistral | {"use_sliding_window": False}).sliding_window == 8  # Mistral reads no switch
    mixtral = {k: v for k, v in hf.config_to_hf(PRESETS["mixtral-tiny"]).items()
               if k not in ("rope_theta", "rope_parameters", "rms_norm_eps", "num_local_experts",
                            "num_experts_per_tok", "sliding_window")}
    cfg = hf.config_from_hf(mixtral)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_experts, cfg.experts_per_token, cfg.sliding_window) == (
        1e6, 1e-5, 8, 2, 0)
    with pytest.raises(ShardError, match="has qkv_bias with a sliding window"):
        hf.config_to_hf(dataclasses.replace(PRESETS["mistral-tiny"], qkv_bias=True))
    with pytest.raises(ShardError, match="has router_scores='sigmoid'; Mixtral's router is a softmax"):
        hf.config_to_hf(PRESETS["moe-fine-tiny"])


# config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen3-0.6B on the Hugging Face Hub (the keys that shape them)
REAL = {
    # mistralai/Mistral-7B-v0.1 and mistralai/Mixtral-8x7B-v0.1
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
                   "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                   "tie_word_embeddings": False, "vocab_size": 32000},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
                     "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                     "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
                     "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                     "vocab_size": 32000},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
                     "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
                     "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
                     "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
                     "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
                     "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
                   "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
                   "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                   "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936},
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                      "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                      "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
                      "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                      "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
                      "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                      "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
                      "use_sliding_window": False, "vocab_size": 151936},
    # google/gemma-2-2b and google/gemma-3-1b-pt
    "gemma2-2b": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
                  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
                  "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
                  "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
                  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
                  "vocab_size": 256000},
    "gemma3-1b": {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
                  "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
                  "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
                  "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                  "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144},
}


def test_a_padded_vocab_is_counted_apart_from_the_model_as_transformers_counts():
    """Stored tables round the vocab up to a multiple of 128; the count printed was the stored one
    (0.34M for 330,112): the model's own count is transformers', the padding printed apart."""
    from flax import nnx

    from shard import models
    from shard.observe.console import params_phrase

    for tied in (True, False):
        cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=320, tie_embeddings=tied)
        config_json = hf.config_to_hf(cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config_json))
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
        stored = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda c=cfg: models.build(c)))))
        assert stored - cfg.num_params() == cfg.vocab_padding_params() == (384 - 320) * 64 * (1 if tied else 2)
    assert params_phrase(cfg) == "0.12M params + 8,192 vocab padding"
    assert params_phrase(PRESETS["tiny"]) == "0.10M params"


@pytest.mark.parametrize("name", list(REAL))
def test_presets_are_the_real_models_with_transformers_parameter_count(name):
    """The preset is what import-hf makes of the real config.json, and its parameter count is that of
    transformers' model (built on the meta device: no memory, no download)."""
    preset = PRESETS[name]
    assert dataclasses.replace(hf.config_from_hf(REAL[name]), name=name) == preset
    tiny = "qwen3-moe-tiny" if name == "qwen3-30b-a3b" else f"{name.split('.')[0].split('-')[0]}-tiny"
    for cfg in (preset, PRESETS[tiny]):
        config_json = hf.config_to_hf(cfg)
        hf_cfg = getattr(transformers, CONFIG_CLASSES[config_json["model_type"]])(**config_json)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters()), cfg.name
    assert preset.num_params() == {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920,
                                   "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704,
                                   "gemma2-2b": 2_614_341_888, "gemma3-1b": 999_885_952,
                                   "qwen3-30b-a3b": 30_532_122_624}[name]


@pytest.mark.parametrize("kind, change, message", [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for gemma2"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]},
     "is not every k-th layer global"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                         "sliding_attention": {"rope_type": "linear", "factor": 8.0}}},
     "rope scaling .* of the sliding_attention layers is not supported"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number or null"),
    ("gemma2", {"model_type": "gemma3"}, "model_type 'gemma3' is Gemma 3 with its vision tower"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"decoder_sparse_step=1 with mlp_only_layers=\[0\] is not supported"),
    ("qwen3_moe", {"num_experts": 0}, "num_experts must be a positive integer, got 0"),
], ids=["exact-gelu", "bidirectional", "irregular-layers", "linear-rope", "negative-cap", "multimodal",
        "qwen3-moe-dense-layers", "qwen3-moe-no-experts"])
def test_what_gemma_cannot_be_is_refused_in_one_line(kind, change, message):
    base = hf.config_to_hf(PRESETS["qwen3-moe-tiny" if kind == "qwen3_moe" else f"{kind[:6]}-tiny"])
    with pytest.raises(ShardError, match=message) as e:
        hf.config_from_hf(base | change)
    assert "\n" not in str(e.value)


def test_gemma_round_trips_its_config_and_refuses_half_a_gemma():
    """config.json written for each Gemma preset reads back as the preset; Gemma's features without its
    sandwich norms, or sandwich norms with experts, are no family export-hf can write."""
    for name in ("gemma2-2b", "gemma3-1b", "gemma2-tiny", "gemma3-tiny"):
        back = hf.config_from_hf(hf.config_to_hf(PRESETS[name]))  # the dtype and remat are shard's, not the model's
        assert dataclasses.replace(back, name=name, compute_dtype=PRESETS[name].compute_dtype,
                                   remat=PRESETS[name].remat) == PRESETS[name]
    with pytest.raises(ShardError, match="has attn_softcap=5.0 without Gemma's sandwich_norms"):
        hf.config_to_hf(dataclasses.replace(PRESETS["tiny"], attn_softcap=5.0))
    with pytest.raises(ShardError, match="has sandwich_norms with mlp_activation='silu'"):
        hf.config_to_hf(dataclasses.replace(PRESETS["moe-tiny"], sandwich_norms=True, norm_plus_one=True,
                                            embed_scale=True))
