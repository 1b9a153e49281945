"""YaRN (Qwen's long-context and DeepSeek-V3's configs) and linear RoPE scaling (Gemma 3's global layers)
against transformers: random tiny models built with from_config import with equal frequencies,
attention factor and logits (float32, rtol 1e-4), and export back to folders transformers reads the same.
Skipped where torch/transformers are absent (the `hf` extra)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.config.model import ModelConfig, yarn_mscale  # noqa: E402
from shard.errors import ShardError  # noqa: E402
from shard.models import llama  # noqa: E402
from shard.run import hf  # noqa: E402

# RoPE base 100 and an original context of 64, so over the 64 positions compared every kind of dim
# turns: head_dim 8's four frequencies are kept, blended (two) and interpolated by YaRN's ramp
_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, initializer_range=0.2, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "qwen2-yarn": ("Qwen2Config", {"rope_parameters": YARN | {"beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": YARN}),  # the attention factor from the factor alone
    "gemma3-linear": ("Gemma3TextConfig", {
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6, "eos_token_id": None,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}}),
}
TOKENS = np.random.default_rng(0).integers(0, 256, (1, 64)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def scaled(request, tmp_path_factory):
    cls, keys = CASES[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**_SIZES, **keys)).float().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    config_json, tensors = hf.read_hf_dir(str(path))
    ours = dataclasses.replace(hf.config_from_hf(config_json), compute_dtype="float32")
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    return model, ours, hf.params_from_hf(tensors, ours), theirs


def _logits(cfg, params) -> np.ndarray:
    return np.asarray(jax.jit(lambda p, t: llama.forward(cfg, p, t)[0])(params, jnp.asarray(TOKENS)))


def test_scaled_rope_matches_transformers_and_exports_back(scaled, tmp_path):
    model, cfg, params, theirs = scaled
    rotary = model.model.rotary_emb
    if cfg.rope_scaling_type == "linear":  # Gemma 3: the global layers' table; the local ones' is plain
        assert (cfg.rope_scaling, cfg.rope_local_theta) == (8.0, 10.0)
        np.testing.assert_allclose(cfg.rope_frequencies(), rotary.full_attention_inv_freq.numpy(), rtol=1e-6)
        np.testing.assert_allclose(cfg.rope_frequencies(local=True), rotary.sliding_attention_inv_freq.numpy(),
                                   rtol=1e-6)
    else:
        assert cfg.rope_scaling_type == "yarn" and cfg.rope_original_context == 64
        np.testing.assert_allclose(cfg.rope_frequencies(), rotary.inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_attention_scale() == pytest.approx(rotary.attention_scaling, rel=1e-12)
        assert cfg.rope_attention_scale() != 1.0
    plain = dataclasses.replace(cfg, rope_scaling=0.0)
    assert not np.allclose(plain.rope_frequencies(), cfg.rope_frequencies())
    np.testing.assert_allclose(_logits(cfg, params), theirs, rtol=1e-4, atol=2e-5)
    assert np.abs(_logits(plain, params) - theirs).max() > 1e-2  # the scaling shows in these logits
    hf.write_hf_dir(str(tmp_path), cfg, params)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        np.testing.assert_allclose(again(torch.tensor(TOKENS)).logits.numpy(), theirs, rtol=1e-5, atol=1e-5)


def test_yarn_reads_transformers_defaults_and_refuses_what_it_cannot_hold():
    base = hf.config_to_hf(ModelConfig(name="t", d_model=64, n_heads=8, n_kv_heads=4, head_dim=8, mlp_dim=128))
    # Qwen2.5's long-context spelling: the legacy key, `type`, no betas; factor from the context ratio
    legacy = hf.config_from_hf(base | {"max_position_embeddings": 131072, "rope_scaling": {
        "type": "yarn", "original_max_position_embeddings": 32768}})
    assert (legacy.rope_scaling, legacy.rope_beta_fast, legacy.rope_beta_slow) == (4.0, 32.0, 1.0)
    assert legacy.rope_attention_scale() == pytest.approx(yarn_mscale(4.0)) == pytest.approx(1 + 0.1 * np.log(4))
    with pytest.raises(ShardError, match="partial_rotary_factor=0.5 is not supported"):
        hf.config_from_hf(base | {"rope_scaling": YARN | {"partial_rotary_factor": 0.5}})
    with pytest.raises(ShardError, match="yarn rope scaling's beta_fast must be a positive number, got 'x'"):
        hf.config_from_hf(base | {"rope_scaling": YARN | {"beta_fast": "x"}})
    with pytest.raises(ShardError, match="needs 0 < rope_beta_slow < rope_beta_fast"):
        hf.config_from_hf(base | {"rope_scaling": YARN | {"beta_fast": 0.5}})
    assert ModelConfig(rope_scaling_type="ntk").validate() == [
        "model.rope_scaling_type must be one of llama3, yarn, linear, got 'ntk'"]
