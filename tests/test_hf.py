"""Hugging Face round trip: a Llama built locally with transformers imports with equal logits, generates
the same greedy tokens, and exports back to identical tensors. Skipped where torch/transformers are absent
(they belong to the `hf` extra, not shard's core)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from shard.run import hf  # noqa: E402
from shard import models  # noqa: E402
from shard.config.presets import PRESETS  # noqa: E402
from shard.errors import ShardError  # noqa: E402
from shard.training.generate import Generator, Sampling  # noqa: E402
from shard.sharding.layout import make_layout  # noqa: E402
from shard.sharding.mesh import parse_mesh  # noqa: E402
from shard.training.state import state_spec  # noqa: E402
from shard.testing import devices_for, tiny_config  # noqa: E402

TOKENS = [[5, 17, 99, 200, 3, 42, 7, 128, 64, 1]]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request, tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5,
                                   tie_word_embeddings=request.param)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


def _shard_model(path):
    hf_config, tensors = hf.read_hf_dir(str(path))
    cfg = dataclasses.replace(hf.config_from_hf(hf_config), compute_dtype="float32")
    params = hf.params_from_hf(tensors, cfg)
    model = models.build(cfg)
    nnx.update(model, nnx.State(params))
    return cfg, params, model


def test_logits_match_transformers(hf_model):
    model, path = hf_model
    _, _, ours = _shard_model(path)
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), theirs, atol=1e-4)


def test_greedy_generation_matches_transformers(hf_model):
    model, path = hf_model
    cfg, params, _ = _shard_model(path)
    with torch.no_grad():
        theirs = model.generate(torch.tensor(TOKENS), max_new_tokens=8, do_sample=False, pad_token_id=0)
    tc = tiny_config("1x1")
    layout = make_layout(tc, parse_mesh("1x1"), devices_for("1x1"))
    graphdef = state_spec(cfg, tc.optimizer, 3, layout).graphdef
    gen = Generator(cfg, graphdef, jax.device_put(params), layout, max_len=32)
    assert gen.generate(TOKENS[0], 8, Sampling(temperature=0)) == theirs[0, len(TOKENS[0]):].tolist()


def test_export_reloads_in_transformers_with_identical_tensors(hf_model, tmp_path):
    model, path = hf_model
    cfg, params, _ = _shard_model(path)
    hf.write_hf_dir(str(tmp_path), cfg, params)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ref = model.state_dict()
    for name, t in again.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), ref[name].numpy(), err_msg=name)


def test_what_shard_cannot_represent(tmp_path):
    base = hf.config_to_hf(PRESETS["tiny"])
    with pytest.raises(ShardError, match="llama3 rope scaling needs a positive low_freq_factor, got None"):
        hf.config_from_hf(base | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ShardError, match="rope scaling .* is not supported"):
        hf.config_from_hf(base | {"rope_scaling": {"type": "dynamic", "factor": 2.0}})
    # plain RoPE spelled out in the older key is plain RoPE (it was refused, by a message saying it's fine)
    assert hf.config_from_hf(base | {"rope_scaling": {"rope_type": "default"}}) == hf.config_from_hf(base)
    with pytest.raises(ShardError, match="model_type 'gpt2'"):
        hf.config_from_hf(base | {"model_type": "gpt2"})
    cfg = hf.config_from_hf(base)
    tensors = hf.params_to_hf(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(cfg)))), cfg)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ShardError, match="lacks tensor model.layers.1.mlp.up_proj.weight"):
        hf.params_from_hf(tensors, cfg)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ShardError, match=r"up_proj.weight has shape \(3, 3\), the config implies \(128, 64\)"):
        hf.params_from_hf(tensors, cfg)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # head_dim 8: one frequency kept, one blended, two scaled


def test_llama3_rope_scaling_matches_transformers_and_exports_back(tmp_path):
    """Llama 3.1 and 3.2 scale RoPE's low frequencies: their folders were refused."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "in")
    ours_cfg, params, ours = _shard_model(tmp_path / "in")
    assert (ours_cfg.rope_scaling, ours_cfg.rope_original_context) == (8.0, 64)
    positions = [list(range(1, 61))]  # far enough for the scaled frequencies to turn
    with torch.no_grad():
        theirs = model(torch.tensor(positions)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(positions))), theirs, atol=1e-4)
    np.testing.assert_allclose(ours_cfg.rope_frequencies(), model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    plain = dataclasses.replace(ours_cfg, rope_scaling=0.0).rope_frequencies()
    assert (plain == ours_cfg.rope_frequencies()).tolist() == [True, False, False, False]  # kept, blended, scaled
    hf.write_hf_dir(str(tmp_path / "out"), ours_cfg, params)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        np.testing.assert_allclose(again(torch.tensor(positions)).logits.numpy(), theirs, atol=1e-5)
