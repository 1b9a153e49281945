"""Muon (optimizer.name = "muon"): its update against a float64 NumPy Newton-Schulz, which weights it
orthogonalises (experts one by one), the same losses on every test layout, and the configs it refuses."""

import jax
import numpy as np
import pytest

from shard import config as c
from shard.config.presets import PRESETS
from shard.config.train import OptimizerConfig
from shard.errors import ShardError
from shard.testing import agreement_config, assert_same_curves, train_curves
from shard.training.optimizers import muon_dimension_numbers
from shard.training.state import make_optimizer

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, optax's default


def newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-8) -> np.ndarray:
    """Muon's orthogonalisation of one matrix in float64: Frobenius-normalised, then the quintic
    X <- aX + (bA + cA^2)X, A = XX^T, on the wide orientation."""
    x = g.astype(np.float64)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / (np.linalg.norm(x) + eps)
    a, b, c_ = NS_COEFFS
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c_ * m @ m) @ x
    return x if wide else x.T


def test_muon_update_is_newton_schulz_of_the_nesterov_momentum_per_matrix_and_expert():
    model = PRESETS["moe-tiny"]
    opt = OptimizerConfig(name="muon", lr=0.01, warmup_steps=0, weight_decay=0.0, grad_clip=float("inf"))
    tx, _ = make_optimizer(opt, 10, model)
    from flax import nnx

    from shard import models

    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: models.build(model))))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), params)
    params = jax.tree.map(np.zeros_like, grads)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    beta = opt.muon_beta
    nesterov = beta * (1 - beta) / (1 - beta**2) + 1.0  # first step: beta * m_hat + (1 - beta) * g_hat
    D, N, H = model.d_model, model.n_heads, model.head_dim
    wq = grads["layers"]["wq"][1].reshape(D, N * H)  # layer 1: embed -> heads x head_dim
    want = -opt.lr * 0.2 * max(D, N * H) ** 0.5 * newton_schulz(nesterov * wq)
    np.testing.assert_allclose(updates["layers"]["wq"][1].reshape(D, N * H), want, rtol=2e-4, atol=2e-6)
    wo = grads["layers"]["wo"][0].reshape(N * H, D)  # heads x head_dim -> embed
    want = -opt.lr * 0.2 * max(D, N * H) ** 0.5 * newton_schulz(nesterov * wo)
    np.testing.assert_allclose(updates["layers"]["wo"][0].reshape(N * H, D), want, rtol=2e-4, atol=2e-6)
    down = grads["layers"]["w_down"][1, 3]  # layer 1, expert 3 alone: (mlp, embed)
    want = -opt.lr * 0.2 * max(down.shape) ** 0.5 * newton_schulz(nesterov * down)
    np.testing.assert_allclose(updates["layers"]["w_down"][1, 3], want, rtol=2e-4, atol=2e-6)
    # the embedding, norms and the router's AdamW: Adam's first step is lr * sign(g) (NAdam: more)
    assert np.all(np.sign(updates["embed"]) == -np.sign(grads["embed"]))


def test_muon_orthogonalises_the_layer_matrices_and_leaves_the_rest_to_adamw():
    dims = muon_dimension_numbers(PRESETS["qwen2-tiny"])
    layers = dims["layers"]
    assert dims["embed"] is None and dims["final_norm"] is None  # vocab rows; a norm
    assert layers["wq"].reduction_axis == (1,) and layers["wq"].output_axis == (2, 3)  # (L, D, N, H)
    assert layers["wo"].reduction_axis == (1, 2) and layers["wo"].output_axis == (3,)  # (L, N, H, D)
    assert layers["w_down"].reduction_axis == (1,) and layers["w_down"].output_axis == (2,)  # (L, F, D)
    assert layers["bq"] is None and layers["attn_norm"] is None  # biases and norms: constants at init
    experts = muon_dimension_numbers(PRESETS["moe-tiny"])["layers"]
    assert experts["w_gate"].reduction_axis == (2,) and experts["w_gate"].output_axis == (3,)  # (L, E, D, F)


@pytest.fixture(scope="module")
def muon_reference():
    return train_curves(agreement_config("1x1", optimizer__name="muon"))


@pytest.mark.parametrize("mesh", ["fsdp_tp:4x2", "data=2,fsdp=2,model=2"])
def test_muon_gives_the_same_losses_on_every_layout(mesh, muon_reference):
    assert_same_curves(train_curves(agreement_config(mesh, optimizer__name="muon")), muon_reference, 1e-5, mesh)


def test_muon_is_not_adamw(muon_reference):
    adamw = train_curves(agreement_config("1x1"))
    assert muon_reference["loss"][0] == pytest.approx(adamw["loss"][0])  # the same start
    assert abs(muon_reference["loss"][-1] - adamw["loss"][-1]) > 1e-2


@pytest.mark.parametrize("items, message", [
    (["optimizer.name=sgd"], "optimizer.name must be one of adamw, muon, got 'sgd'"),
    (["optimizer.name=muon", "lora.rank=4"], "optimizer.name=muon does not train LoRA adapters"),
    (["optimizer.muon_beta=1"], r"optimizer.muon_beta must be in \[0, 1\)"),
    (["optimizer.muon_ns_steps=0"], "optimizer.muon_ns_steps must be between 1 and 100"),
    (["optimizer.qk_clip=-1"], r"optimizer.qk_clip must be 0 \(off\) or a positive logit"),
    (["optimizer.qk_clip=100", "model.name=qwen3-tiny"], "optimizer.qk_clip with model.qk_norm"),
])
def test_bad_muon_configs_are_one_line(items, message):
    with pytest.raises(ShardError, match=message):
        c.resolve(c.parse_sets(items))
