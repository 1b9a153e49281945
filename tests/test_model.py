"""The model's pieces: attention implementations agree, presets are consistent, init is sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shard import models
from shard.config.presets import PRESETS
from shard.models.attention import causal_attention
from shard.sharding.decisions import attention_backend, cudnn_attention_problem


@pytest.mark.parametrize("impl", ["xla", "auto"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_matches_reference(kv_heads, impl):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (2, 16, 4, 8))
    k = jax.random.normal(k2, (2, 16, kv_heads, 8))
    v = jax.random.normal(k3, (2, 16, kv_heads, 8))
    np.testing.assert_allclose(causal_attention(q, k, v, impl), causal_attention(q, k, v, "reference"),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, problem", [
    ({"platform": "cuda", "dtype": "bfloat16", "head_dim": 64}, ""),
    ({"platform": "cuda", "dtype": "float16", "head_dim": 128}, ""),
    ({"platform": "cpu", "dtype": "bfloat16", "head_dim": 64}, "NVIDIA GPU"),
    ({"platform": "rocm", "dtype": "bfloat16", "head_dim": 64}, "NVIDIA GPU"),
    ({"platform": "cuda", "dtype": "float32", "head_dim": 64}, "bfloat16 or float16"),
    ({"platform": "cuda", "dtype": "bfloat16", "head_dim": 60}, "multiple of 8"),
    ({"platform": "cuda", "dtype": "bfloat16", "head_dim": 256}, "up to 128"),
    ({"platform": "cuda", "dtype": "bfloat16", "head_dim": 64, "same_split": False}, "same mesh axes"),
    ({"platform": "cuda", "dtype": "bfloat16", "head_dim": 64, "manual": True}, "pipeline stages"),
])
def test_auto_attention_takes_cudnn_only_where_it_runs(kw, problem):
    found = cudnn_attention_problem(**kw)
    assert problem in found if problem else found == ""
    assert attention_backend("auto", found) == ("xla" if problem else "cudnn")
    for setting in ("xla", "cudnn", "reference"):
        assert attention_backend(setting, found) == setting


def test_attention_is_causal():
    q = k = v = jax.random.normal(jax.random.key(1), (1, 8, 2, 4))
    out = causal_attention(q, k, v, "reference")
    v2 = v.at[:, 5:].set(100.0)  # the future must not leak into positions 0..4
    out2 = causal_attention(q, k, v2, "reference")
    np.testing.assert_allclose(out[:, :5], out2[:, :5])
    assert not np.allclose(out[:, 5:], out2[:, 5:])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_counts_its_parameters(name):
    cfg = PRESETS[name]
    assert cfg.validate() == []
    abstract = nnx.eval_shape(lambda: models.build(cfg))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
    assert n == cfg.num_params() + cfg.vocab_padding_params()  # the stored tables hold the padding too


def test_reference_model_is_13b_with_24_layers():
    cfg = PRESETS["llama-13b-24l"]
    assert cfg.n_layers == 24 and 12.5e9 < cfg.num_params() < 13.5e9


def test_logits_shape_and_dtype():
    cfg = PRESETS["tiny"]
    model = models.build(cfg)
    logits = model(jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32


def test_bf16_compute_keeps_fp32_master_params_and_close_logits():
    import dataclasses

    cfg = PRESETS["tiny"]
    model32 = models.build(cfg)
    model16 = models.build(dataclasses.replace(cfg, compute_dtype="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model16)))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    l32, l16 = model32(tokens), model16(tokens)
    assert l16.dtype == jnp.float32  # softmax and loss stay in fp32
    assert float(jnp.max(jnp.abs(l32 - l16))) < 0.1 and not np.array_equal(l32, l16)


def _dot_generals(jaxpr):
    """Every dot_general in a jaxpr and the jaxprs inside it (scan, custom_vjp, pjit, remat)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _dot_generals(inner)


@pytest.mark.parametrize("tied", [True, False])
def test_the_output_heads_backward_matmuls_run_in_bf16(tied):
    """With bf16 compute, all of the head's matmuls (those over the vocab) take bf16 operands; plain
    autodiff of the float32 logits ran both backward ones in float32, 13% of a 1B model's FLOPs at half
    the speed. The gradients stay within bf16's rounding of the float32 ones."""
    import dataclasses

    from shard.models import llama

    cfg = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg), nnx.Param))
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)

    def loss(params, cfg):
        return jnp.mean(jax.nn.log_softmax(llama.forward(cfg, params, tokens)[0])[..., 0])

    cfg16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, cfg16).jaxpr
    head = [e for e in _dot_generals(jaxpr) if any(cfg.vocab_size in v.aval.shape for v in e.invars)]
    assert len(head) >= 3, head  # the forward's (once more inside custom_vjp) and the two backward ones
    assert all(v.aval.dtype == jnp.bfloat16 for e in head for v in e.invars), head
    g16, g32 = jax.grad(loss)(params, cfg16), jax.grad(loss)(params, cfg)
    name = "embed" if tied else "unembed"
    np.testing.assert_allclose(g16[name], g32[name], atol=0.05 * float(jnp.max(jnp.abs(g32[name]))))
