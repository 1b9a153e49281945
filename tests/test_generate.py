"""Generation: the KV-cache path equals the full forward, and the mesh does not change the tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import models
from shard.errors import ShardError
from shard.training.generate import Generator, Sampling, sample
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.training.state import init_state, state_spec
from shard.testing import devices_for, tiny_config

PROMPT = [72, 101, 108, 108, 111, 32, 119]


def _generator(mesh, max_len=32, **kw):
    cfg = tiny_config(mesh, model__n_kv_heads=4, **kw)
    layout = make_layout(cfg, parse_mesh(mesh), devices_for(mesh))
    spec = state_spec(cfg.model, cfg.optimizer, 3, layout)
    params = init_state(spec, cfg.model, 0)["params"]
    return cfg, params, Generator(cfg.model, spec.graphdef, params, layout, max_len=max_len)


@pytest.fixture(scope="module")
def single():
    return _generator("1x1")


def test_cached_greedy_decoding_equals_recomputing_the_full_forward(single):
    cfg, params, gen = single
    tokens = gen.generate(PROMPT, 8, Sampling(temperature=0))
    model = models.build(cfg.model)
    from flax import nnx

    nnx.update(model, nnx.State(jax.device_get(params)))
    seq = list(PROMPT)
    for _ in range(8):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq]))[0, -1])))
    assert tokens == seq[len(PROMPT):]


def test_mixture_of_experts_generation_drops_no_token():
    """Routing capacity came from each call's length: a 7-token prefill dropped tokens that decode steps
    (length 1) never drop. Generation is dropless: it equals the full forward with room for every token."""
    import dataclasses

    from flax import nnx

    cfg, params, gen = _generator("1x1", model__name="moe-tiny")
    tokens = gen.generate(PROMPT, 8, Sampling(temperature=0))
    roomy = dataclasses.replace(cfg.model, capacity_factor=cfg.model.n_experts / cfg.model.experts_per_token)
    model = models.build(roomy)
    nnx.update(model, nnx.State(jax.device_get(params)))
    seq = list(PROMPT)
    for _ in range(8):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq]))[0, -1])))
    assert tokens == seq[len(PROMPT):]


def test_tensor_parallel_generation_gives_the_same_tokens(single):
    _, _, gen1 = single
    _, _, gen8 = _generator("2x4")
    greedy = Sampling(temperature=0)
    assert gen8.generate(PROMPT, 8, greedy) == gen1.generate(PROMPT, 8, greedy)
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9)
    assert gen8.generate(PROMPT, 8, sampled, seed=3) == gen1.generate(PROMPT, 8, sampled, seed=3)


def test_context_parallel_generation_takes_any_length(single):
    """The `cp` mesh splits `length` 4 ways in training; a cache of 15 positions (prompt + 8) raised
    IndivisibleError with a traceback. Generation replicates the sequence."""
    _, _, gen1 = single
    _, _, gen_cp = _generator("cp", max_len=len(PROMPT) + 8)
    greedy = Sampling(temperature=0)
    assert gen_cp.generate(PROMPT, 8, greedy) == gen1.generate(PROMPT, 8, greedy)


def test_sampling_filters():
    """Each filter's distribution, from 20,000 independent draws (one row each, one key): top-k and top-p
    keep the tokens they should and renormalise them; temperature sharpens; greedy and a tiny temperature
    take the largest logit in every row."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.broadcast_to(jnp.asarray(probs), (20_000, 4)))

    def frequencies(s: Sampling) -> np.ndarray:
        return np.bincount(np.asarray(sample(logits, jax.random.key(0), s)), minlength=4) / len(logits)

    top2 = np.array([0.5, 0.3, 0, 0]) / 0.8
    for s, want in ((Sampling(), probs), (Sampling(top_k=1), [1, 0, 0, 0]), (Sampling(top_k=2), top2),
                    (Sampling(top_p=0.7), top2),  # 0.5 + 0.3 covers 0.7; the tail is cut
                    (Sampling(top_p=0.9), np.array([0.5, 0.3, 0.15, 0]) / 0.95),
                    (Sampling(temperature=0.5), probs**2 / (probs**2).sum())):
        np.testing.assert_allclose(frequencies(s), want, atol=0.015, err_msg=str(s))
    rows = jax.random.normal(jax.random.key(1), (1000, 50))
    greedy = np.asarray(jnp.argmax(rows, -1))
    assert (np.asarray(sample(rows, jax.random.key(2), Sampling(temperature=0))) == greedy).all()
    # a tiny temperature is greedy: logits / 1e-38 overflowed to inf everywhere, and index 0 won
    assert (np.asarray(sample(rows, jax.random.key(2), Sampling(temperature=1e-38))) == greedy).all()


def test_bad_prompts(single):
    _, _, gen = single
    with pytest.raises(ShardError, match="exceed 32"):
        gen.generate(PROMPT, 30, Sampling())
    with pytest.raises(ShardError, match="token ids must lie in 0..255"):
        gen.generate([300], 2, Sampling())
    for several in ([[1, 2], [3, 4]], [[1, 2], [3]], ["a"]):  # a batch of prompts, ragged, not ids
        with pytest.raises(ShardError, match="a prompt is one sequence of token ids"):
            gen.generate(several, 2, Sampling())
    # an array (what ByteTokenizer.encode returns) is a prompt: "truth value of an array is ambiguous"
    assert gen.generate(np.asarray(PROMPT), 3, Sampling(temperature=0)) == gen.generate(PROMPT, 3, Sampling(temperature=0))
    np.testing.assert_equal(len(gen.generate(PROMPT, 3, Sampling(temperature=1.0), seed=1)), 3)


def test_generation_and_evaluation_compute_in_float32_on_any_cpu():
    """bfloat16 pays on a CPU only in training with full remat: inference keeps the float32 weights'
    math and holds no bf16 copy of them."""
    from shard.config.presets import PRESETS

    assert PRESETS["small"].for_inference("cpu").compute_dtype == "float32"
    assert PRESETS["small"].for_inference("gpu").compute_dtype == "auto"  # bfloat16 there
    pinned = dataclasses.replace(PRESETS["small"], compute_dtype="bfloat16")
    assert pinned.for_inference("cpu").compute_dtype == "bfloat16"  # asked for by name
