"""FP8 training as rules (shard.config.precision, shard.models.fp8): which weights the rules pick, the
quantize/dequantize math against a NumPy reference, and the float8 dots a lowered train step holds."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import config as c
from shard.config.precision import fp8_weights, weight_recipes
from shard.errors import ShardError
from shard.models import fp8

# (mantissa bits, smallest normal exponent, largest value) of float8_e4m3fn and float8_e5m2
FORMATS = {fp8.E4M3: (3, -6, 448.0), fp8.E5M2: (2, -14, 57344.0)}


def np_round(v, fmt):
    """NumPy reference: v (already within range) rounded to nearest even on the format's grid,
    subnormals included."""
    mant, min_exp, _ = FORMATS[fmt]
    v = np.asarray(v, np.float64)
    a = np.abs(v)
    e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), min_exp)
    quantum = 2.0 ** (e - mant)
    return np.sign(v) * np.round(a / quantum) * quantum


def np_quantize(x, fmt, axes=None, scale=None):
    """NumPy reference: (x / scale saturated and rounded, the float32 scale amax / fmax, 1 where amax is 0)."""
    fmax = np.float32(FORMATS[fmt][2])
    if scale is None:
        amax = np.max(np.abs(x), axis=axes, keepdims=axes is not None).astype(np.float32)
        scale = np.where(amax > 0, amax / fmax, np.float32(1)).astype(np.float32)
    return np_round(np.clip(x / scale, -fmax, fmax), fmt), scale


def wide_range(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 3, shape)).astype(np.float32)


def resolve(*sets, model="tiny"):
    return c.resolve(c.parse_sets([f"model.name={model}", *sets]))


def test_rules_pick_the_matmul_weights_and_defaults_leave_the_rest(tmp_path):
    cfg = resolve("precision.default=fp8_tensorwise", 'precision."layers/w(q|k|v|o)"=fp8_rowwise')
    got = weight_recipes(cfg.precision, cfg.model)
    assert got == {"layers/wq": "fp8_rowwise", "layers/wk": "fp8_rowwise", "layers/wv": "fp8_rowwise",
                   "layers/wo": "fp8_rowwise", "layers/w_gate": "fp8_tensorwise",
                   "layers/w_up": "fp8_tensorwise", "layers/w_down": "fp8_tensorwise"}
    assert weight_recipes({}, cfg.model) == {}  # bf16 unless asked
    # experts, router, embeddings, norms and head are never FP8 candidates; a dense first stack's MLP is
    moe = resolve(model="moe-tiny").model
    assert fp8_weights(moe) == ["layers/wq", "layers/wk", "layers/wv", "layers/wo"]
    # the experts' grouped matmuls only where a rule names them, tensorwise
    experts = weight_recipes({"default": "fp8_rowwise", "layers/w_(gate|up)": "fp8_tensorwise"}, moe)
    assert experts == {"layers/wq": "fp8_rowwise", "layers/wk": "fp8_rowwise", "layers/wv": "fp8_rowwise",
                       "layers/wo": "fp8_rowwise", "layers/w_gate": "fp8_tensorwise", "layers/w_up": "fp8_tensorwise"}
    from shard.measure.flops import fp8_matmul_params  # the planner counts the experts a token runs, k of E

    assert fp8_matmul_params(moe, {"layers/w_(gate|up|down)": "fp8_tensorwise"}) == pytest.approx(
        moe.n_layers * 3 * moe.d_model * moe.mlp_dim * moe.experts_per_token)
    toml = tmp_path / "fp8.toml"  # the config file form
    toml.write_text('[model]\nname = "tiny"\n[precision]\n"layers/w(q|k|v|o)" = "fp8_rowwise"\n'
                    '"layers/w_(gate|up|down)" = "fp8_tensorwise"\n')
    from_file = c.resolve(c.load_file(str(toml)))
    assert weight_recipes(from_file.precision, from_file.model) == got


@pytest.mark.parametrize("item, message", [
    ('precision."layers/wqq"=fp8_rowwise', "precision rule 'layers/wqq' decides no matmul weight of tiny"),
    ("precision.embed=fp8_rowwise", "precision rule 'embed' decides no matmul weight"),
    ("precision.default=fp9", "precision.default: unknown recipe 'fp9'"),
    ('precision."layers/wq"=int4', "unknown recipe 'int4' (one of bf16, fp8_tensorwise, fp8_rowwise, fp8_delayed)"),
    ('model.name=moe-tiny precision."layers/w_down"=fp8_rowwise',
     "precision rule 'layers/w_down' puts the experts' layers/w_down in fp8_rowwise: their grouped matmuls run in "
     "fp8_tensorwise only"),
    ("precision.default=fp8_delayed cluster.cross_host=mpi",
     "precision recipe fp8_delayed does not run with cluster.cross_host=mpi yet"),
    ('precision.default=fp8_delayed task=grpo grpo.rewards=["answer"]',  # was a KeyError tracing GRPO's step
     "precision recipe fp8_delayed does not run with task grpo yet"),
])
def test_bad_precision_rules_are_one_line(item, message):
    with pytest.raises(ShardError, match=re.escape(message)):
        resolve(*item.split())


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("axes", [None, (1,)])
def test_quantize_matches_numpy(fmt, axes):
    x = wide_range((6, 40))
    x[2] = 0.0  # a row of zeros: scale 1, zeros out
    q, scale = fp8.quantize(jnp.asarray(x), fmt, axes)
    # XLA divides by the constant fmax as a multiply by its reciprocal: within an ulp of amax / fmax
    np.testing.assert_allclose(np.asarray(scale), np_quantize(x, fmt, axes)[1], rtol=2e-7)
    want_q, want_scale = np_quantize(x, fmt, scale=np.asarray(scale))  # rounding, exactly
    np.testing.assert_array_equal(np.asarray(q, np.float64), want_q)
    assert np.max(np.abs(np.asarray(q, np.float32))) == FORMATS[fmt][2]  # amax maps to the largest value
    back = np.asarray(fp8.dequantize(q, scale))
    np.testing.assert_allclose(back, want_q * want_scale, rtol=1e-6)
    # saturation: a scale below amax / fmax clips to the format's largest value, sign kept
    small = np.float32(np.max(np.abs(x)) / FORMATS[fmt][2] / 4)
    q_sat, _ = fp8.quantize(jnp.asarray(x), fmt, scale=jnp.asarray(small))
    np.testing.assert_array_equal(np.asarray(q_sat, np.float64), np_quantize(x, fmt, scale=small)[0])
    assert np.sum(np.abs(np.asarray(q_sat, np.float32)) == FORMATS[fmt][2]) > 1


@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_einsum_and_its_gradients_match_numpy(rowwise):
    x, w, g = wide_range((2, 5, 16), 1), wide_range((16, 3, 4), 2), wide_range((2, 5, 3, 4), 3)

    def qdq(a, fmt, contract):  # the reference: each operand quantized and dequantized, float64 einsum
        q, s = np_quantize(a, fmt, contract if rowwise else None)
        return q * s

    y, pullback = jax.vjp(lambda a, b: fp8.fp8_einsum("btd,dnh->btnh", a, b, rowwise), jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(y, np.einsum("btd,dnh->btnh", qdq(x, fp8.E4M3, (2,)), qdq(w, fp8.E4M3, (0,))),
                               rtol=1e-5, atol=1e-5 * np.abs(y).max())
    dx, dw = pullback(jnp.asarray(g))
    want_dx = np.einsum("btnh,dnh->btd", qdq(g, fp8.E5M2, (2, 3)), qdq(w, fp8.E4M3, (1, 2)))
    want_dw = np.einsum("btd,btnh->dnh", qdq(x, fp8.E4M3, (0, 1)), qdq(g, fp8.E5M2, (0, 1)))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5 * np.abs(want_dx).max())
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5 * np.abs(want_dw).max())


def test_fp8_ragged_dot_and_its_gradients_match_numpy():
    """The experts' grouped matmul in FP8: row group e against w[e] (an empty group included), E4M3
    forward, E5M2 gradient against E4M3 weight (dx) and activation (dw), per-tensor scales."""
    x, w, g = wide_range((12, 16), 7), wide_range((3, 16, 8), 8), wide_range((12, 8), 9)
    sizes = np.array([5, 0, 7])
    group = np.repeat(np.arange(3), sizes)  # each row's expert

    def qdq(a, fmt):
        q, s = np_quantize(a, fmt)
        return q * s

    y, pullback = jax.vjp(lambda a, b: fp8.fp8_ragged_dot(a, b, jnp.asarray(sizes, jnp.int32)), jnp.asarray(x),
                          jnp.asarray(w))
    xq, wq, gq = qdq(x, fp8.E4M3), qdq(w, fp8.E4M3), qdq(g, fp8.E5M2)
    want = np.einsum("md,mdf->mf", xq, wq[group])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    dx, dw = pullback(jnp.asarray(g))
    want_dx = np.einsum("mf,mdf->md", gq, wq[group])
    want_dw = np.stack([np.einsum("md,mf->df", xq[group == e], gq[group == e]) for e in range(3)])
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5 * np.abs(want_dx).max())
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5 * np.abs(want_dw).max())
    assert not np.any(np.asarray(dw[1]))  # the empty group's expert gets no gradient


def test_a_rule_on_the_experts_puts_their_grouped_matmuls_in_fp8():
    """moe-tiny (8 experts of 64x64): three float8 dots per expert stack, forward, dx and dw (XLA:CPU
    lowers `ragged_dot` as a masked dense dot_general, which keeps the float8 operands)."""
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.compiled import lower_step

    cfg = tiny_config("1x1", model__name="moe-tiny", **{"precision__layers/w_(gate|up|down)": "fp8_tensorwise"})
    dots = _f8_dots(lower_step(cfg, make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))).as_text())
    assert len(dots) == 9, dots
    assert sum("tensor<8x64x64xf8E4M3FN>" in d[1] for d in dots) == 6  # the expert weights: forward and dx


def _f8_dots(text: str) -> list[tuple[str, list[str], str]]:
    """(result name, operand types, result type) of each StableHLO dot_general on float8 operands."""
    out = []
    for line in text.splitlines():
        m = re.search(r"(%\S+) = stablehlo.dot_general .*: \((.*)\) -> (tensor<[^>]*>)", line)
        if m and "f8" in m.group(2):
            out.append((m.group(1), re.findall(r"tensor<[^>]*>", m.group(2)), m.group(3)))
    return out


def test_a_train_step_has_float8_dots_for_the_rule_matched_weights_only_and_gathers_one_scale_ones_in_float8():
    from shard.measure.analysis import analyze
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.compiled import lower_step

    # wk, wv in bf16: q, k and v run as three einsums; gate and up share a recipe: one (64, 2, 128) weight;
    # w_down (tensorwise) and wo (delayed): one scale each, quantized as stored and gathered in float8
    cfg = tiny_config("fsdp", model__n_kv_heads=4, precision__default="fp8_rowwise",
                      **{"precision__layers/w(k|v)": "bf16", "precision__layers/w_down": "fp8_tensorwise",
                         "precision__layers/wo": "fp8_delayed"})
    layout = make_layout(cfg, parse_mesh("fsdp"), devices_for("fsdp"))
    lowered = lower_step(cfg, layout)
    text = lowered.as_text()
    dots = _f8_dots(text)
    fp8_shapes = {"wq": "64x8x8", "wo": "8x8x64", "w_gate/w_up": "64x2x128", "w_down": "128x64"}
    for name, shape in fp8_shapes.items():
        forward = [d for d in dots if f"tensor<{shape}xf8E4M3FN>" in d[1] and "f8E5M2" not in "".join(d[1])]
        dx = [d for d in dots if f"tensor<{shape}xf8E4M3FN>" in d[1] and "f8E5M2" in "".join(d[1])]
        dw = [d for d in dots if d[2] == f"tensor<{shape}xf32>"]
        assert (len(forward), len(dx), len(dw)) == (1, 1, 1), (name, forward, dx, dw)
    assert len(dots) == 3 * len(fp8_shapes)  # nothing else: wk, wv (64x4x8), embedding, head stay bf16
    assert not any("64x4x8" in t or "256" in t for d in dots for t in d[1])
    for result, _, _ in dots:  # the scales are applied to the float32 product, after the dot
        assert re.search(rf"stablehlo.multiply {re.escape(result)}, ", text), result
    # compiled on fsdp=8: the float8 all-gathers are w_down's and wo's, per layer (XLA:CPU widens them to f16,
    # the HLO reader counts the float8 bytes); rowwise and bf16 weights gather in the compute dtype. The
    # analysis raises if the cost model's minimum (float8 gathers at 1 byte) exceeded the bytes moved.
    analysis = analyze(cfg, layout, lowered.compile())
    f8 = {c.result_bytes // 2 for c in analysis.collectives if c.kind == "all-gather" and "f8e4m3fn" in c.compiled_as}
    assert f8 == {128 * 64, 8 * 8 * 64}, f8
    assert analysis.efficiency["fsdp"] > 0.98, analysis.efficiency  # less: rowwise's per-row amax all-reduces


def test_delayed_scaling_scales_by_the_history_and_its_gradient_is_the_update():
    x, w, g = wide_range((4, 16), 4), wide_range((16, 8), 5), wide_range((4, 8), 6)
    history = {k: jnp.zeros(4, jnp.float32).at[1].set(v) for k, v in (("x", 3000.0), ("w", 50.0), ("g", 1e6))}
    y, pullback = jax.vjp(lambda a, b, h: fp8.delayed_einsum("td,df->tf", a, b, h), jnp.asarray(x), jnp.asarray(w),
                          history)
    sx, sw, sg = 3000.0 / 448, 50.0 / 448, 1e6 / 57344  # the history's amax, not this step's
    want = np.einsum("td,df->tf", np_quantize(x, fp8.E4M3, scale=np.float32(sx))[0] * np.float32(sx),
                     np_quantize(w, fp8.E4M3, scale=np.float32(sw))[0] * np.float32(sw))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    dx, _, new = pullback(jnp.asarray(g))
    want_dx = np.einsum("tf,df->td", np_quantize(g, fp8.E5M2, scale=np.float32(sg))[0] * np.float32(sg),
                        np_quantize(w, fp8.E4M3, scale=np.float32(sw))[0] * np.float32(sw))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5 * np.abs(want_dx).max())
    for k, a in (("x", x), ("w", w), ("g", g)):  # this step's amax first, the oldest dropped
        np.testing.assert_array_equal(new[k], [np.abs(a).max(), 0, float(history[k][1]), 0])


def test_delayed_histories_are_train_state_a_checkpoint_keeps_onto_another_mesh_and_a_resume_continues_bitwise(
        tmp_path):
    """The resume: a fresh run prepared from the step-2 checkpoint on disk (what a restart after kill -9
    reads; the checkpoint's atomicity under kill -9 is tests/test_checkpoint.py's) continues the
    uninterrupted run's losses and amax histories bit for bit."""
    from shard.run.checkpoint import Checkpoints, SaveCheckpoints
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.loop import train
    from shard.training.prepare import prepare
    from shard.training.state import state_spec

    cfg = tiny_config("2x4", steps=4, checkpoint__every=2, precision__default="fp8_delayed",
                      **{"precision__layers/wo": "fp8_rowwise"})
    ckpts = Checkpoints(tmp_path / "checkpoints", cfg.checkpoint)
    try:
        run = prepare(cfg, devices_for("2x4"))
        saver = SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=c.to_toml(cfg))
        losses = [r["loss"] for r in train(cfg, run=run, observers=[saver])]
        saved = jax.device_get(run.state["fp8"])
        assert sorted(saved["layers"]) == ["w_down", "w_gate", "w_up", "wk", "wq", "wv"]  # wo: rowwise, none
        for history in jax.tree.leaves(saved):  # (layers, 16): four steps' amaxes, newest first
            assert history.shape == (2, 16) and np.all(history[:, :4] > 0) and not np.any(history[:, 4:])
        resumed = prepare(cfg, devices_for("2x4"), restore=lambda spec: ckpts.restore(2, spec))
        assert resumed.start_step == 2
        assert [r["loss"] for r in train(cfg, run=resumed)] == losses[2:]  # bitwise
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["fp8"]), saved)
        # --init-from these weights: a fresh state around them starts its histories empty and trains (the
        # histories were missing from it: a pytree mismatch at the first step)
        from shard.run.weights import state_from
        weights = jax.device_get(run.state["params"])
        started = prepare(cfg, devices_for("2x4"), restore=lambda spec: state_from(weights, spec, cfg.seed, "init"))
        assert not any(np.any(h) for h in jax.tree.leaves(jax.device_get(started.state["fp8"])))
        assert len([r["loss"] for r in train(cfg, run=started)]) == 4
        layout = make_layout(cfg, parse_mesh("fsdp"), devices_for("fsdp"))
        restored = ckpts.restore(4, state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)).state["fp8"]
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
        plain = tiny_config("fsdp", steps=4)  # a resume in bf16 leaves them out
        layout = make_layout(plain, parse_mesh("fsdp"), devices_for("fsdp"))
        assert "fp8" not in ckpts.restore(4, state_spec(plain.model, plain.optimizer, 4, layout)).state
        # other fp8_delayed weights: their histories start empty, the checkpoint read and checked as saved
        other = tiny_config("fsdp", steps=4, precision__default="fp8_delayed", **{"precision__layers/w_down": "bf16"})
        layout = make_layout(other, parse_mesh("fsdp"), devices_for("fsdp"))
        fresh = ckpts.restore(4, state_spec(other.model, other.optimizer, 4, layout)).state["fp8"]
        assert "w_down" not in fresh["layers"] and not any(np.any(h) for h in jax.tree.leaves(jax.device_get(fresh)))
    finally:
        ckpts.close()


def test_layouts_agree_with_fp8_on():
    """1x1, fsdp and 2x4 in FP8: the scales are global amaxes, so layouts differ only where a float32
    partial sum rounds differently and flips an FP8 rounding downstream. Measured (tiny, one step): 8e-8
    for tensorwise and delayed, rowwise on fsdp 1.8e-5 in the loss and 2.6e-4 in the gradient norm.
    Through the pipeline (GPipe, 2 microbatches, fsdp beside the stages) current scaling takes each
    microbatch's amaxes, so the scales themselves differ and every element re-rounds on E4M3's grid (steps
    of 2^-4 relative): measured 9.4e-4 in the loss and 4.4e-3 in the gradient norm, tested at about 3x.
    One step from the init that is near bf16's own gap (1.8e-3, 1.1e-2), so the pipeline's compiled
    program is also checked for its float8 dots."""
    from shard.testing import loss_and_grads, tiny_config

    sets = {"precision__default": "fp8_tensorwise", "precision__layers/w(q|k|v|o)": "fp8_rowwise"}
    meshes = {"1x1": {}, "fsdp": {}, "2x4": {}, "stage=2,data=2,fsdp=2": {"pipeline__microbatches": 2}}
    curves = {}
    for mesh, extra in meshes.items():
        loss, grads, hlo = loss_and_grads(tiny_config(mesh, **sets, **extra), with_hlo=True)
        assert "f8e4m3fn" in hlo and "f8e5m2" in hlo, mesh
        curves[mesh] = (float(loss), float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64))
                                                       for g in jax.tree.leaves(grads)))))
    for mesh, (loss_rtol, norm_rtol) in {"fsdp": (1e-4, 1e-3), "2x4": (1e-4, 1e-3),
                                         "stage=2,data=2,fsdp=2": (3e-3, 1.5e-2)}.items():
        np.testing.assert_allclose(curves[mesh][0], curves["1x1"][0], rtol=loss_rtol, err_msg=f"loss {mesh}")
        np.testing.assert_allclose(curves[mesh][1], curves["1x1"][1], rtol=norm_rtol, err_msg=f"grad_norm {mesh}")


def test_the_hardware_table_has_datasheet_fp8_peaks_where_there_are_fp8_tensor_cores():
    from shard.hardware import load_hardware

    table = load_hardware()
    assert table["h100"].fp8_tflops == table["h200"].fp8_tflops == 1979.0  # SXM: 3,958 with sparsity
    assert table["a100-80g"].fp8_tflops is None and table["cpu"].fp8_tflops is None


def test_delayed_scaling_resumes_bitwise_after_a_kill_9(tmp_path):
    """kill -9 while the step-4 checkpoint is written (tests/helpers/killed_in_save.py: no timing race),
    then `--resume`: the run continues from step 2's checkpoint, and steps 3 and 4, whose scales come
    from the restored amax histories, repeat the killed run's records bit for bit."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from shard.observe.metrics import read_jsonl
    from shard.testing import finish, subprocess_env

    run_dir = tmp_path / "r"
    args = ["train", "--model", "tiny", "--mesh", "2x4", "--steps", "4", "--batch", "8", "--seq", "32",
            "--log-every", "1", "--checkpoint-every", "2", "--set", "precision.default=fp8_delayed",
            "--run-dir", str(run_dir)]
    killer = Path(__file__).parent / "helpers" / "killed_in_save.py"
    env = subprocess_env(SHARD_TEST_KILL_AT=f"{re.escape(str(run_dir / 'checkpoints'))}/4$")
    [(rc, _, err)] = finish([subprocess.Popen([sys.executable, str(killer), *args], env=env, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)])
    assert rc == -signal.SIGKILL, err[-3000:]
    killed = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert 3 in killed, killed
    [(rc, _, err)] = finish([subprocess.Popen([sys.executable, "-m", "shard", *args, "--resume"], text=True,
                                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)])
    assert rc == 0 and "resumed from step 2 " in err, err[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    again = {r["step"]: r for r in records[len(killed):]}
    for step in sorted(set(killed) & {3, 4}):
        assert (again[step]["loss"], again[step]["grad_norm"]) == (killed[step]["loss"], killed[step]["grad_norm"])
