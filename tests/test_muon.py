"""Muon (optimizer.name = "muon"): its update against a float64 NumPy Newton-Schulz, which weights it
orthogonalises (experts one by one), the same losses on every test layout, and the configs it refuses."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import config as c
from shard.config.presets import PRESETS
from shard.config.train import OptimizerConfig
from shard.errors import ShardError
from shard.testing import agreement_config, assert_same_curves
from shard.training.optimizers import _layer_axes, muon_dimension_numbers
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
    # sharded, each device orthogonalises the matrices of the layers the axes dividing the layer count give it
    mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 2, "model": 2})
    assert [_layer_axes(mesh, n) for n in (2, 4, 8, 3)] == [("data",), ("data", "fsdp"), ("data", "fsdp", "model"), ()]


TAU = 3.0  # below the tiny model's largest logits (~5), so QK-clip acts from the first step


def _muon_run(mesh: str, **sets) -> tuple[dict, list]:
    """Muon with QK-clip: (train_curves' loss and grad_norm, each step's largest logit before the clip)."""
    from shard.training.loop import train

    records = train(agreement_config(mesh, optimizer__name="muon", optimizer__qk_clip=TAU, **sets),
                    devices=jax.devices()[:1] if mesh == "1x1" else None)
    return {k: [r[k] for r in records] for k in ("loss", "grad_norm")}, [r["max_logit"] for r in records]


@pytest.fixture(scope="module")
def muon_reference():
    return _muon_run("1x1")


def test_muon_with_qk_clip_gives_the_same_losses_sharded_over_every_axis(muon_reference):
    """Newton-Schulz on matrices split over fsdp and model (data too), and the per-head largest logit of
    heads split over model, over two microbatches (the largest of theirs): one layout with every axis of
    the test meshes stands for them (test_layouts.py checks the others agree for AdamW); fsdp_tp:4x2
    agreed as well when this was written."""
    mesh = "data=2,fsdp=2,model=2"
    curves, top = _muon_run(mesh, data__microbatches=2)
    assert_same_curves(curves, muon_reference[0], 1e-5, mesh)
    np.testing.assert_allclose(top, muon_reference[1], rtol=1e-5)


def test_the_step_trains_with_muon_and_qk_clip_acts(muon_reference):
    from optax.contrib import MuonState

    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.training.state import state_spec

    cfg = agreement_config("1x1", optimizer__name="muon")
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, make_layout(cfg, parse_mesh("1x1"), jax.devices()[:1]))
    assert any(isinstance(x, MuonState) for x in jax.tree.leaves(
        spec.abstract["opt_state"], is_leaf=lambda x: isinstance(x, MuonState)))
    top = muon_reference[1]
    # the first step's heads past TAU were brought back to it: unclipped, the logits grow (4.89 -> 5.01)
    assert top[0] > TAU + 1 and top[1] < top[0] - 0.5


@pytest.mark.parametrize("items, message", [
    (["optimizer.name=sgd"], "optimizer.name must be one of adamw, muon, got 'sgd'"),
    (["optimizer.name=muon", "lora.rank=4"], "optimizer.name=muon does not train LoRA adapters"),
    (["optimizer.muon_beta=1"], r"optimizer.muon_beta must be in \[0, 1\)"),
    (["optimizer.muon_ns_steps=0"], "optimizer.muon_ns_steps must be between 1 and 100"),
    (["optimizer.qk_clip=-1"], r"optimizer.qk_clip must be 0 \(off\) or a positive logit"),
    (["optimizer.qk_clip=100", "model.name=qwen3-tiny"], "optimizer.qk_clip with model.qk_norm"),
    (["optimizer.qk_clip=100", "lora.rank=4"], "optimizer.qk_clip does not run with lora.rank"),
    (["optimizer.qk_clip=100", "task=sft", "cluster.cross_host=mpi"],  # sft records the logits: the bridge is why
     "optimizer.qk_clip does not run with cluster.cross_host=mpi"),
])
def test_bad_muon_configs_are_one_line(items, message):
    with pytest.raises(ShardError, match=message):
        c.resolve(c.parse_sets(items))


def test_max_logits_are_the_largest_scaled_score_each_head_may_see():
    """Brute force in NumPy: grouped-query heads, a window of 5, two segments, over query chunks."""
    from shard.models.attention import max_logits

    rng = np.random.default_rng(1)
    B, T, N, K, H, window = 2, 16, 4, 2, 8, 5
    q, k = rng.normal(size=(B, T, N, H)).astype(np.float32), rng.normal(size=(B, T, K, H)).astype(np.float32)
    seg = np.repeat(np.array([[1] * 9 + [2] * 7]), B, 0).astype(np.int32)
    want = np.full(N, -np.inf)
    for b, t, s, n in np.ndindex(B, T, T, N):
        if 0 <= t - s < window and seg[b, t] == seg[b, s]:
            want[n] = max(want[n], q[b, t, n] @ k[b, s, n // (N // K)] * 0.3)
    for chunk in (0, 4):
        got = max_logits(jnp.asarray(q), jnp.asarray(k), 0.3, window, jnp.asarray(seg), chunk)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa"])
def test_qk_clip_brings_the_heads_past_tau_back_to_tau_and_leaves_the_rest(kv_heads):
    from flax import nnx

    from shard import models
    from shard.models import llama
    from shard.training.optimizers import qk_clip

    model = dataclasses.replace(PRESETS["tiny"], n_kv_heads=kv_heads, compute_dtype="float32", qkv_bias=True)
    params = nnx.to_pure_dict(nnx.state(models.build(model, seed=0)))
    params["layers"]["bq"] = 0.3 * jnp.ones_like(params["layers"]["bq"])  # a bias scales with its weight
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)))

    @jax.jit
    def top(p):
        return llama.forward_hidden(model, p, tokens, max_logits=True)[2]["max_logit"]

    before = np.asarray(top(params))  # (layers, heads)
    tau = float(np.median(before[0]))  # half of layer 0's heads past it
    after = np.asarray(top(qk_clip(params, jnp.asarray(before), tau, model)))
    np.testing.assert_allclose(after[0], np.minimum(before[0], tau), rtol=1e-5)
    assert np.all(after[1] <= np.maximum(before[1], tau) + 1e-5)  # layer 1 sees layer 0's clipped output


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_planner_counts_the_optimizer_state_the_optimizer_holds(name):
    """shard.measure.memory.optimizer_bytes against the state optax makes for the DeepSeek tiny twin with
    an MTP module (MLA, experts, dense layers): Muon keeps one momentum per matrix, AdamW two moments."""
    from flax import nnx

    from shard import models
    from shard.measure.costs import LayoutShape, Workload
    from shard.measure.memory import optimizer_bytes

    model = dataclasses.replace(PRESETS["deepseek-v3-tiny"], mtp_depth=1)
    tx, _ = make_optimizer(OptimizerConfig(name=name), 10, model)
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: models.build(model))))
    moments = [x for path, x in jax.tree_util.tree_leaves_with_path(jax.eval_shape(tx.init, params))
               if {"mu", "nu"} & {getattr(k, "name", None) for k in path}]  # not counts nor Newton-Schulz's coefficients
    held = sum(x.size * x.dtype.itemsize for x in moments)
    assert held == optimizer_bytes(model, LayoutShape.of(data=1), Workload(1, 1, optimizer=name))
    if name == "muon":
        adamw = optimizer_bytes(model, LayoutShape.of(data=1), Workload(1, 1))
        assert 0.5 * adamw < held < 0.75 * adamw
