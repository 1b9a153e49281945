"""Mixture of experts: dropless routing by grouped matmul and the router's features equal a per-token
reference, drop no token, agree across layouts; bad MoE configs are one-line errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import config as c
from shard.config.presets import PRESETS
from shard.errors import ShardError
from shard.models import moe
from shard.parallel import expert_exchange
from shard.testing import devices_for, loss_and_grads, tiny_config
from shard.training.loop import train

E, D, F, B, T = 8, 16, 12, 2, 6
ROUTERS = {  # name: router settings
    "mixtral": dict(router_scores="softmax", router_normalize=True),  # softmax over the k chosen logits
    "switch": dict(router_scores="softmax", router_normalize=False),  # softmax over all, top-k kept as is
    "deepseek-v3": dict(router_scores="sigmoid", router_normalize=True, routed_scale=2.5),
}


def _cfg(routing="dropless", shared=0, k=2, **router):
    return dataclasses.replace(PRESETS["moe-tiny"], d_model=D, mlp_dim=F, n_experts=E, experts_per_token=k,
                               moe_routing=routing, n_shared_experts=shared, **router)


def _params(shared=0, skew=0.0, seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    p = dict(router=jax.random.normal(ks[0], (D, E)), w_gate=0.3 * jax.random.normal(ks[1], (E, D, F)),
             w_up=0.3 * jax.random.normal(ks[2], (E, D, F)), w_down=0.3 * jax.random.normal(ks[3], (E, F, D)))
    p["router"] = p["router"].at[:, 0].add(skew)  # skew > 0: expert 0 is everyone's favourite
    if shared:
        S = shared * F
        p |= dict(shared_gate=0.3 * jax.random.normal(ks[4], (D, S)),
                  shared_up=0.3 * jax.random.normal(ks[5], (D, S)),
                  shared_down=0.3 * jax.random.normal(ks[6], (S, D)))
    return p


def _tokens(seed=1):
    return jnp.abs(jax.random.normal(jax.random.key(seed), (B, T, D)))  # positive: the skew shows


def _swiglu(x_d, g_df, u_df, d_fd):
    return (jax.nn.silu(x_d @ g_df) * (x_d @ u_df)) @ d_fd


def per_token_reference(h_btd, p, cfg):
    """Each token on its own, in numpy-sized steps: its top-k experts by score, gate * expert(token)
    summed, plus the shared experts."""
    out = np.zeros(h_btd.shape, np.float32)
    for b in range(h_btd.shape[0]):
        for t in range(h_btd.shape[1]):
            x = h_btd[b, t]
            logits = np.asarray(x @ p["router"], np.float64)
            if cfg.router_scores == "sigmoid":
                scores = 1 / (1 + np.exp(-logits))
            else:
                scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-scores, kind="stable")[:cfg.experts_per_token]
            gates = scores[top] / (scores[top].sum() if cfg.router_normalize else 1.0) * cfg.routed_scale
            y = sum(g * _swiglu(x, p["w_gate"][e], p["w_up"][e], p["w_down"][e]) for g, e in zip(gates, top))
            if cfg.n_shared_experts:
                y = y + _swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"])
            out[b, t] = y
    return out


def dense_reference(h_btd, p, cfg):
    """The same, vectorised and differentiable: every expert on every token, weighted by the dense gates."""
    scores_bte, _ = moe.router_scores(moe.router_logits(h_btd, p["router"]), cfg)
    gates_btk, experts_btk = moe.top_k_gates(scores_bte, cfg)
    gates_bte = jnp.einsum("btke,btk->bte", jax.nn.one_hot(experts_btk, E), gates_btk)
    hidden_btef = jax.nn.silu(jnp.einsum("btd,edf->btef", h_btd, p["w_gate"])) * jnp.einsum(
        "btd,edf->btef", h_btd, p["w_up"])
    out_btd = jnp.einsum("btef,efd,bte->btd", hidden_btef, p["w_down"], gates_bte)
    if cfg.n_shared_experts:
        out_btd = out_btd + moe.shared_experts(h_btd, p, jnp.float32)
    return out_btd


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_equals_a_per_token_loop_over_experts(router, shared):
    cfg, p, h = _cfg(shared=shared, **ROUTERS[router]), _params(shared), _tokens()
    out = moe.moe_block(h, p, cfg, jnp.float32)[0]
    np.testing.assert_allclose(out, per_token_reference(h, p, cfg), rtol=1e-5, atol=1e-5)


def test_softmax_after_top_k_is_the_renormalised_softmax():
    """Mixtral's softmax over the k chosen logits is the softmax over all experts, renormalised over
    the k chosen: router_normalize with softmax scores."""
    logits = jax.random.normal(jax.random.key(3), (B, T, E))
    gates, experts = moe.top_k_gates(jax.nn.softmax(logits), _cfg(**ROUTERS["mixtral"]))
    np.testing.assert_allclose(gates, jax.nn.softmax(jnp.take_along_axis(logits, experts, -1)), rtol=1e-6)


def test_dropless_gradients_equal_the_dense_reference():
    cfg, p, h = _cfg(shared=1, **ROUTERS["deepseek-v3"]), _params(1), _tokens()
    weights = jax.random.normal(jax.random.key(4), (B, T, D))  # a loss that weighs every output

    def loss(fn):
        return jax.grad(lambda p, h: jnp.sum(weights * fn(h, p)), argnums=(0, 1))(p, h)

    got = loss(lambda h, p: moe.moe_block(h, p, cfg, jnp.float32)[0])
    want = loss(lambda h, p: dense_reference(h, p, cfg))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_no_token_is_dropped_where_capacity_drops_them():
    """Everyone prefers expert 0: capacity routing (factor 1) drops tokens, dropless drops none."""
    p, h = _params(skew=3.0), _tokens()
    cfg = _cfg()
    gates, experts = moe.top_k_gates(moe.router_scores(moe.router_logits(h, p["router"]), cfg)[0], cfg)
    assert int(jnp.sum(experts[..., 0] == 0)) == B * T  # the skew took
    load_e = jnp.bincount(experts.reshape(-1), length=E)  # the group sizes the grouped matmuls get
    assert int(load_e.sum()) == B * T * cfg.experts_per_token
    routed = {}
    for routing in ("capacity", "dropless"):
        c_ = dataclasses.replace(cfg, moe_routing=routing, capacity_factor=1.0)
        routed[routing] = np.asarray(moe.moe_block(h, p, c_, jnp.float32)[0])
    ref = per_token_reference(h, p, cfg)
    np.testing.assert_allclose(routed["dropless"], ref, rtol=1e-5, atol=1e-5)
    wrong = np.abs(routed["capacity"] - ref).max(axis=-1) > 1e-4  # tokens that lost an expert's share
    assert int(wrong.sum()) > 0 and int((np.abs(routed["dropless"] - ref).max(axis=-1) > 1e-4).sum()) == 0


def test_routing_is_dropless_unless_asked():
    """A mixture of experts drops no token unless capacity routing is asked for (issue 53: moe-tiny on
    data=2,expert=4 dropped thousands of tokens a step by default)."""
    from shard import config

    assert config.resolve({"model": {"name": "moe-tiny"}}).model.moe_routing == "dropless"
    assert {PRESETS[name].moe_routing for name in PRESETS if PRESETS[name].n_experts} == {"dropless"}
    asked = config.resolve({"model": {"name": "moe-tiny", "moe_routing": "capacity"}})
    assert asked.model.moe_routing == "capacity"


def test_capacity_with_room_for_every_token_equals_dropless():
    cfg, p, h = _cfg(shared=1, **ROUTERS["deepseek-v3"]), _params(1), _tokens()
    roomy = dataclasses.replace(cfg, moe_routing="capacity", capacity_factor=E / cfg.experts_per_token)
    out, aux, _ = moe.moe_block(h, p, cfg, jnp.float32)
    out_c, aux_c, counts_c = moe.moe_block(h, p, roomy, jnp.float32)
    assert float(counts_c["dropped"]) == 0
    np.testing.assert_allclose(out_c, out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux_c, aux, rtol=1e-6)


def test_router_z_loss_is_the_mean_squared_logsumexp_and_trains_the_router():
    cfg, p, h = _cfg(), _params(), _tokens()
    logits = np.asarray(h, np.float64) @ np.asarray(p["router"], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    z = moe.moe_block(h, p, cfg, jnp.float32)[2]["z"]
    np.testing.assert_allclose(z, np.mean(lse**2), rtol=1e-5)
    # weighted into the objective: the router's gradient changes, the next-token loss does not
    base = dict(model__name="moe-tiny", model__moe_routing="dropless")
    loss0, g0 = loss_and_grads(tiny_config("1x1", **base))
    loss1, g1 = loss_and_grads(tiny_config("1x1", **base, model__router_z_loss_weight=0.1))
    assert loss1 == loss0
    assert not np.allclose(g1["layers"]["router"], g0["layers"]["router"])
    # the last layer's experts come after every router: the z-loss does not reach them
    np.testing.assert_array_equal(g1["layers"]["w_down"][-1], g0["layers"]["w_down"][-1])


# --- layouts -------------------------------------------------------------------------------------------

FINE = {"model__name": "moe-fine-tiny"}  # dropless, sigmoid top-4 of 16, one shared expert


@pytest.fixture(scope="module")
def fine_reference():
    return loss_and_grads(tiny_config("1x1", **FINE))


EXPERT_PARALLEL = ("ep", "data=2,fsdp=2,expert=2")  # the expert axis also splits the batch


# the expert axis beside tensor parallel (the experts' hidden dim split over model) and FSDP
EXPERT_PARALLEL_PLUS = ("data=2,expert=2,model=2", "fsdp=2,expert=4")


@pytest.mark.parametrize("mesh", ["8x1", "fsdp", *EXPERT_PARALLEL, *EXPERT_PARALLEL_PLUS, "data=2,model=4", "sp"])
def test_dropless_training_agrees_across_layouts(mesh, fine_reference):
    loss, grads, hlo = loss_and_grads(tiny_config(mesh, **FINE), with_hlo=True)
    np.testing.assert_allclose(loss, fine_reference[0], rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(fine_reference[1])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))), err_msg=str(path))
    if mesh in EXPERT_PARALLEL:
        assert_tokens_move_to_the_experts(hlo, PRESETS["moe-fine-tiny"])


@pytest.mark.parametrize("mesh", EXPERT_PARALLEL)
def test_the_gpu_ragged_exchange_trains_as_the_others_do(mesh, fine_reference, monkeypatch):
    """GPUs and TPUs move the tokens by ragged all-to-all (expert_exchange.expert_exchange); its padded
    twin runs that path here, through the whole model, forward and backward."""
    monkeypatch.setattr(expert_exchange, "expert_exchange", lambda platform: "padded-ragged")
    loss, grads = loss_and_grads(tiny_config(mesh, **FINE))
    np.testing.assert_allclose(loss, fine_reference[0], rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(fine_reference[1])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))), err_msg=str(path))


def assert_tokens_move_to_the_experts(hlo: str, cfg):
    """Under expert parallel the tokens travel, by all-to-all, to the experts' devices and back, forward
    and backward; the expert stacks (E, D, F) are never gathered (they were: 3 all-gathers of
    f32[16,64,32] a layer on `ep`, and their gradients reduce-scattered)."""
    E, D, F = cfg.n_experts, cfg.d_model, cfg.mlp_dim
    assert hlo.count(" all-to-all(") >= 4, "no all-to-all"  # dispatch and return, forward and backward
    gathered = re.findall(r"\[([\d,]+)\]\S* all-gather\(", hlo)
    assert not {f"{E},{D},{F}", f"{E},{F},{D}"} & set(gathered), gathered


def test_the_fine_grained_preset_trains_on_expert_parallel_and_counts_the_rows_it_sends():
    cfg = tiny_config("ep", **FINE)
    records = train(cfg, devices=devices_for("ep"))
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    # each token to at most the e-1 other devices of the expert axis, once, in every layer; random
    # routing of 4 choices over 4 devices sends most tokens to some (about 2.2 on average)
    e, m = 4, cfg.model
    tokens = cfg.data.batch * cfg.data.seq_len
    for r in records:
        assert tokens * m.n_layers <= r["expert_rows_sent"] <= (e - 1) * tokens * m.n_layers, r


def test_the_deepseek_twin_has_64_experts_top_6_and_2_shared_and_agrees_on_ep():
    """DeepSeekMoE's fine-grained shape (deepseek-moe-16b) through its tiny twin: 64 routed experts top-6
    and 2 shared; expert parallel (16 experts a device) gives the single device's loss and gradients."""
    twin = PRESETS["deepseek-moe-tiny"]
    full = PRESETS["deepseek-moe-16b"]
    for cfg in (twin, full):
        assert (cfg.n_experts, cfg.experts_per_token, cfg.n_shared_experts, cfg.moe_routing) == (64, 6, 2, "dropless")
    ref_loss, ref_grads = loss_and_grads(tiny_config("1x1", model__name="deepseek-moe-tiny"))
    loss, grads = loss_and_grads(tiny_config("ep", model__name="deepseek-moe-tiny"))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))))


# --- bad configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("items, message", [
    (["model.name=moe-tiny", "model.experts_per_token=9"], r"model.experts_per_token must be in 1..8, got 9"),
    (["model.name=tiny", "model.n_shared_experts=1"], r"model.n_shared_experts=1 needs routed experts"),
    (["model.name=moe-tiny", "model.moe_routing=megablox"], r"model.moe_routing must be one of capacity, dropless"),
    (["model.name=moe-tiny", "model.router_scores=relu"], r"model.router_scores must be one of softmax, sigmoid"),
    (["model.name=moe-tiny", "model.routed_scale=0"], r"model.routed_scale must be a positive number"),
    (["model.name=tiny", "model.router_bias_update=0.001"], r"model.router_bias_update=0.001 needs routed experts"),
])
def test_bad_moe_configs_are_one_line_errors(items, message):
    with pytest.raises(ShardError, match=message) as e:
        c.resolve(c.parse_sets(items))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--model", "moe-tiny", "--set", "model.experts_per_token=9"], "model.experts_per_token must be in 1..8, got 9"),
    (["--model", "moe-tiny", "--mesh", "ep", "--set", "model.n_experts=6"],
     "6 experts do not divide over the expert axis (4 ways)"),
    (["--model", "tiny", "--set", "model.n_shared_experts=2"], "model.n_shared_experts=2 needs routed experts"),
])
def test_bad_moe_configs_exit_2_with_one_line(args, message, tmp_path):
    from typer.testing import CliRunner

    from shard.cli.app import app

    result = CliRunner().invoke(app, ["train", *args, "--steps", "1", "--batch", "8", "--seq", "32",
                                      "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
