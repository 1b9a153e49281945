"""A vocabulary the mesh cannot divide (259 here, like GPT-2's 50257) is padded inside shard to a multiple
of 128: a Llama built with transformers imports onto a mesh that splits `vocab` four ways, gives
transformers' logits and loss on the real ids and its greedy tokens, and exports back bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.config.presets import PRESETS  # noqa: E402
from shard.models import llama  # noqa: E402
from shard.run import hf, weights  # noqa: E402
from shard.sharding.layout import make_layout  # noqa: E402
from shard.sharding.mesh import parse_mesh  # noqa: E402
from shard.sharding.rules import activation_layout  # noqa: E402
from shard.testing import devices_for, tiny_config  # noqa: E402
from shard.training.generate import Generator, Sampling  # noqa: E402
from shard.training.state import state_spec  # noqa: E402
from shard.training.step import token_nll  # noqa: E402

VOCAB = 259
MESH = "fsdp=2,model=4"  # the default rules split vocab over model: 259 rows do not divide by 4
TOKENS = [[5, 17, 258, 200, 3, 42, 7, 128, 257, 1]]


def test_padding_is_mesh_independent_and_leaves_multiples_alone():
    assert dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB).padded_vocab == 384
    assert dataclasses.replace(PRESETS["tiny"], vocab_size=50257).padded_vocab == 50304
    for name in ("tiny", "small", "llama-7b", "llama-1b", "qwen3-0.6b"):  # already multiples of 128
        assert PRESETS[name].padded_vocab == PRESETS[name].vocab_size


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padded_vocab_matches_transformers_on_a_vocab_split_mesh(tied, tmp_path):
    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path / "in")

    cfg, params = weights.load(tmp_path / "in")
    cfg = dataclasses.replace(cfg, compute_dtype="float32")
    assert cfg.vocab_size == VOCAB and params["embed"].shape == (384, 64)
    assert not params["embed"][VOCAB:].any()  # zero rows, never looked up

    tc = tiny_config(MESH)
    layout = make_layout(tc, parse_mesh(MESH), devices_for(MESH))
    assert layout.degree("vocab", param=True) == 4
    spec = state_spec(cfg, tc.optimizer, 3, layout)
    placed = weights.place(params, spec)

    tokens = jnp.asarray(TOKENS, jnp.int32)

    def logits_and_nll(p, t):
        with activation_layout(layout):
            logits = llama.forward(cfg, p, t[:, :-1])[0]
        return logits, token_nll(logits, t[:, 1:], jnp.ones(t[:, 1:].shape, jnp.float32))

    ours, (nll, _) = jax.jit(logits_and_nll)(placed, tokens)
    ours = np.asarray(ours)
    with torch.no_grad():
        ref = theirs(torch.tensor(TOKENS)[:, :-1]).logits.numpy()
    assert ours.shape == (1, 9, 384)
    np.testing.assert_allclose(ours[..., :VOCAB], ref, rtol=1e-5, atol=1e-5)
    print(f"max |logit difference| on real ids ({MESH}, tied={tied}): {np.abs(ours[..., :VOCAB] - ref).max():.2e}")
    assert (ours[..., VOCAB:] == np.finfo(np.float32).min).all()  # masked: no mass in the softmax
    ref_nll, _ = token_nll(jnp.asarray(ref), tokens[:, 1:], jnp.ones((1, 9), jnp.float32))
    np.testing.assert_allclose(float(nll), float(ref_nll), rtol=1e-5)

    gen = Generator(cfg, spec.graphdef, placed, layout, max_len=32)
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor(TOKENS), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert gen.generate(TOKENS[0], 8, Sampling(temperature=0)) == greedy[0, len(TOKENS[0]):].tolist()
    # sampling at a high temperature still never picks a padded id
    assert max(gen.generate(TOKENS[0], 8, Sampling(temperature=100.0), seed=1)) < VOCAB

    hf.write_hf_dir(str(tmp_path / "out"), cfg, jax.tree.map(np.asarray, placed))
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.vocab_size == VOCAB
    ref_state = theirs.state_dict()
    for name, t in again.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), ref_state[name].numpy(), err_msg=name)
