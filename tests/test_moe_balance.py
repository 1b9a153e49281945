"""MoE load balancing and its observation: the auxiliary-loss-free bias (DeepSeek-V3) moves a skewed
router's load toward balance, the load metrics equal a hand count, the bias is saved and restored with
checkpoints (and checkpoints without it still restore), a tiny MoE run logs the metrics, and evaluation and
generation choose experts by the saved bias as training did."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import config as config_mod
from shard.config.presets import PRESETS
from shard.models import moe
from shard.observe.metrics import JsonlWriter, read_jsonl
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint import Checkpoints, SaveCheckpoints
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.testing import devices_for, tiny_config
from shard.training.loop import train
from shard.training.prepare import prepare
from shard.training.state import state_spec
from shard.training.step import expert_load_metrics, update_router_bias

E, D, K = 8, 16, 2
MOE_KEYS = ("aux_loss", "router_z_loss", "expert_load_min", "expert_load_max", "expert_load_cv", "tokens_dropped")


def _cfg(**sets):
    return dataclasses.replace(PRESETS["moe-tiny"], d_model=D, mlp_dim=12, n_experts=E, experts_per_token=K, **sets)


def _skewed(n_tokens=256, skew=1.5, seed=0):
    """Router logits of n_tokens tokens where expert 0 is favoured and expert E-1 shunned."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    h_nd = jax.random.normal(k1, (1, n_tokens, D))
    router_de = jax.random.normal(k2, (D, E)) * D**-0.5
    return moe.router_logits(h_nd, router_de) + jnp.linspace(skew, -skew, E)


def _cv(load_e):
    load_e = np.asarray(load_e, np.float64)
    return load_e.std() / load_e.mean()


@pytest.mark.parametrize("scores", ["sigmoid", "softmax"])
def test_the_bias_update_moves_a_skewed_routers_load_toward_balance(scores):
    cfg = _cfg(router_scores=scores, router_bias_update=1e-2)
    scores_bte = moe.router_scores(_skewed(), cfg)[0]

    @jax.jit
    def step(bias_e):
        gates_btk, experts_btk = moe.top_k_gates(scores_bte, cfg, bias_e)
        load_e = moe.expert_load(experts_btk, E)
        return update_router_bias(bias_e[None], load_e[None], cfg.router_bias_update)[0], load_e, gates_btk, experts_btk

    bias_e = jnp.zeros(E, jnp.float32)
    cvs = []
    for _ in range(40):
        bias_e, load_e, gates_btk, experts_btk = step(bias_e)
        cvs.append(_cv(load_e))
    print(f"{scores}: load cv {cvs[0]:.3f} -> {cvs[-1]:.3f} over 40 updates; bias {np.round(bias_e, 3)}")
    assert cvs[0] > 0.4 and max(cvs[-5:]) < cvs[0] / 3
    assert float(bias_e[0]) < 0 < float(bias_e[-1])  # the favourite pushed down, the shunned one up
    # the bias chooses, the scores gate: the gates are the chosen experts' scores, renormalised
    want = jnp.take_along_axis(scores_bte, experts_btk, axis=-1)
    np.testing.assert_allclose(gates_btk, want / want.sum(-1, keepdims=True), rtol=1e-6)


def test_load_metrics_equal_a_hand_count():
    """Capacity routing with 2 slots per expert and sequence: loads, drops and the metrics by hand."""
    cfg = _cfg(moe_routing="capacity", capacity_factor=1.0)  # cap = ceil(2 * 6 * 1 / 8) = 2
    B, T = 2, 6
    ks = jax.random.split(jax.random.key(5), 4)
    p = dict(router=jax.random.normal(ks[0], (D, E)), w_gate=jax.random.normal(ks[1], (E, D, 12)),
             w_up=jax.random.normal(ks[2], (E, D, 12)), w_down=jax.random.normal(ks[3], (E, 12, D)))
    p["router"] = p["router"].at[:, 0].add(2.0)
    h = jnp.abs(jax.random.normal(jax.random.key(6), (B, T, D)))
    bias_e = jnp.zeros(E).at[3].set(10.0)  # everyone also picks expert 3
    _, _, counts = moe.moe_block(h, p, cfg, jnp.float32, bias_e=bias_e)

    cap = cfg.expert_capacity(T)
    logits = np.asarray(h, np.float64) @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # softmax scores: the bias is added to these
    load, dropped = np.zeros(E), 0
    for b in range(B):
        choices = [np.argsort(-(probs[b, t] + np.asarray(bias_e)))[:K] for t in range(T)]
        used = np.zeros(E)
        for k in range(K):  # earlier choices take slots first, then earlier tokens
            for t in range(T):
                e = choices[t][k]
                load[e] += 1
                dropped += used[e] >= cap
                used[e] += 1
    assert load[3] == B * T and dropped > 0
    np.testing.assert_array_equal(counts["load"], load)
    assert float(counts["dropped"]) == dropped

    load_le = np.stack([load, np.roll(load, 1)])
    m = expert_load_metrics(jnp.asarray(load_le), jnp.asarray([dropped, 1.0]), capacity=True)
    share = load_le / load_le.mean(-1, keepdims=True)
    assert float(m["expert_load_min"]) == pytest.approx(share.min())
    assert float(m["expert_load_max"]) == pytest.approx(share.max())
    assert float(m["expert_load_cv"]) == pytest.approx(_cv(load), rel=1e-5)  # the same in both layers
    assert float(m["tokens_dropped"]) == dropped + 1
    assert "tokens_dropped" not in expert_load_metrics(jnp.asarray(load_le), jnp.zeros(2), capacity=False)


def test_programs_without_the_bias_keep_their_state_tree():
    for name in ("tiny", "moe-tiny"):
        cfg = tiny_config("1x1", model__name=name)
        layout = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
        assert set(state_spec(cfg.model, cfg.optimizer, 3, layout).abstract) == {"step", "params", "opt_state"}


def _run(run_dir, cfg, restore=None):
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir), checkpoint=dataclasses.replace(cfg.checkpoint, every=2, keep=5))
    run_dir.mkdir(parents=True, exist_ok=True)
    toml = config_mod.to_toml(cfg)
    ckpts = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint)
    run = prepare(cfg, devices_for(cfg.mesh.spec), restore=restore)
    records = train(cfg, run=run, observers=[SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=toml),
                                             JsonlWriter(run_dir / "metrics.jsonl")])
    return records, run, ckpts


def test_a_tiny_moe_run_balances_logs_the_load_and_checkpoints_the_bias(tmp_path):
    rate = 0.01
    cfg = tiny_config("4x2", model__name="moe-tiny", model__router_bias_update=rate, model__aux_loss_weight=0.0,
                      model__moe_routing="capacity", steps=4)  # capacity: its tokens_dropped is logged too
    records, run, ckpts = _run(tmp_path / "run", cfg)
    try:
        logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in logged] == [1, 2, 3, 4]
        for r in logged:
            assert all(np.isfinite(r[k]) for k in MOE_KEYS), r
            assert r["expert_load_min"] <= 1 <= r["expert_load_max"] and r["tokens_dropped"] >= 0
        bias = np.asarray(jax.device_get(run.state["router_bias"]))
        assert bias.shape == (2, 8) and bias.dtype == np.float32 and np.abs(bias).max() > 0
        assert np.allclose(np.round(bias / rate), bias / rate, atol=1e-3) and np.abs(bias).max() <= 4 * rate + 1e-6
        assert run.state["router_bias"].sharding.is_fully_replicated

        # saved and restored with the bias
        layout = make_layout(cfg, parse_mesh("8x1"), devices_for("8x1"))
        spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
        restored = ckpts.restore(4, spec)
        np.testing.assert_array_equal(np.asarray(restored.state["router_bias"]), bias)

        # restored where balancing is off: left out; a checkpoint without it restores with a zero bias
        off = dataclasses.replace(cfg.model, router_bias_update=0.0)
        spec_off = state_spec(off, cfg.optimizer, cfg.steps, layout)
        plain = ckpts.restore(4, spec_off)
        assert "router_bias" not in plain.state
        at_10 = plain.state | {"step": jax.device_put(np.int32(10), plain.state["step"].sharding)}  # as step 10 holds
        ckpts.save(10, at_10, position=plain.position, seed=cfg.seed, config_toml=plain.config_toml)
        ckpts.wait()
        again = ckpts.restore(10, spec)
        np.testing.assert_array_equal(np.asarray(again.state["router_bias"]), np.zeros((2, 8), np.float32))
        assert again.state["router_bias"].sharding == spec.shardings["router_bias"]
        from shard.run import weights

        assert weights.load_with_router_bias(tmp_path / "run" / CHECKPOINTS_DIR / "10")[2] is None  # none saved
    finally:
        ckpts.close()


def test_report_plots_the_expert_load_of_the_runs_that_log_it(tmp_path):
    import json

    from shard.observe.report import report

    def fake_run(name, extra):
        path = tmp_path / name
        path.mkdir()
        (path / "config.toml").write_text('[model]\nname = "moe-tiny"\n[mesh]\nspec = "ep"\n')
        with open(path / "metrics.jsonl", "w") as f:
            for i in range(1, 4):
                f.write(json.dumps({"step": i, "loss": 3.0, "tokens_per_s": 1.0, "time_s": float(i), **extra(i)}) + "\n")
        return str(path)

    dense = fake_run("dense", lambda i: {})
    assert not any(p.endswith("expert_load_vs_step.png") for p in report([dense], tmp_path / "r1")["plots"])
    balanced = fake_run("moe", lambda i: {"expert_load_cv": 1.0 / i, "expert_load_min": 0.5, "expert_load_max": 2.0})
    plots = report([dense, balanced], tmp_path / "r2")["plots"]
    assert str(tmp_path / "r2" / "expert_load_vs_step.png") in plots
    assert (tmp_path / "r2" / "expert_load_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluation_and_generation_choose_experts_by_the_saved_bias(tmp_path):
    """The in-loop evaluation, `shard eval` of the saved checkpoint and `Generator` all route with the
    run's router bias: the last logged eval loss is what `shard eval` scores, and the bias changes it."""
    import json

    from typer.testing import CliRunner

    from shard.cli.app import app
    from shard.models import llama
    from shard.run import weights
    from shard.training.evaluate import evaluate_checkpoint, held_out_source
    from shard.training.generate import Generator, Sampling
    from shard.training.state import place_router_bias

    cfg = tiny_config("4x2", model__name="moe-tiny", model__router_bias_update=0.02, model__aux_loss_weight=0.0,
                      steps=4, eval__every=2)
    run_dir = tmp_path / "run"
    records, run, ckpts = _run(run_dir, cfg)
    ckpts.close()
    logged = [r["eval_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in r][-1]
    bias = np.asarray(jax.device_get(run.state["router_bias"]))
    model_cfg, params, saved_bias = weights.load_with_router_bias(run_dir)
    np.testing.assert_array_equal(saved_bias, bias)
    assert np.abs(bias).max() > 0

    scored = CliRunner().invoke(app, ["eval", str(run_dir), "--mesh", "4x2", "--json"])
    assert scored.exit_code == 0, scored.output
    with_bias = json.loads(scored.output.strip().splitlines()[-1])["eval_loss"]
    assert with_bias == pytest.approx(logged, rel=1e-5)
    saved, source = held_out_source(weights.saved_run_config(run_dir), None, str(run_dir))
    layout = make_layout(cfg, parse_mesh("4x2"), devices_for("4x2"))
    ignored = evaluate_checkpoint(saved, layout, params, weights.place, saved.eval.batches, source)["eval_loss"]
    print(f"eval loss {with_bias:.6f} with the bias, {ignored:.6f} without")
    assert abs(ignored - with_bias) > 1e-6 * with_bias

    # greedy generation (dropless) equals the argmax of a full forward with room for every token
    layout1 = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    spec = state_spec(model_cfg, cfg.optimizer, 1, layout1)
    prompt, n = [5, 17, 99, 3, 42, 7, 11], 6
    placed = weights.place(params, spec)  # read from the checkpoint into the mesh's shardings
    gen = Generator(model_cfg, spec.graphdef, placed, layout1, max_len=len(prompt) + n,
                    router_bias=place_router_bias(saved_bias, spec))
    tokens = gen.generate(prompt, n, Sampling(temperature=0))
    roomy = dataclasses.replace(model_cfg, capacity_factor=model_cfg.n_experts / model_cfg.experts_per_token)
    seq = list(prompt)
    for _ in range(n):
        logits = llama.forward(roomy, placed, jnp.asarray([seq]), router_bias=jnp.asarray(bias))[0]
        seq.append(int(jnp.argmax(logits[0, -1])))
    assert tokens == seq[len(prompt):]
    plain = Generator(model_cfg, spec.graphdef, placed, layout1, max_len=len(prompt) + n)
    assert plain.generate(prompt, n, Sampling(temperature=0)) != tokens  # the bias chose other experts
