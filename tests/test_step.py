"""The train step's arithmetic against hand computations: the masked loss, the normalised gradient, the
optimizer (schedule, clipping, weight-decay mask), the divergence guard, and sampling. The layout tests
compare layouts with each other, so a mistake here would cancel out there."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shard.config.train import GuardConfig, OptimizerConfig
from shard.errors import ShardError
from shard.training.generate import Sampling, sample
from shard.training.step import check_batch
from shard.training.loop import first_divergence
from shard.training.prepare import prepare
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.training.state import init_state, make_optimizer, state_spec
from shard.training.step import batch_sharding, make_train_step, token_nll
from shard.testing import devices_for, loss_and_grads, random_batch, tiny_config


def test_the_loss_counts_only_unmasked_positions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5))
    mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], np.float32)
    nll, count = token_nll(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -sum(logp[b, t, targets[b, t]] for b in range(2) for t in range(5) if mask[b, t])
    assert float(count) == 7 and float(nll) == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def one_step():
    """The tiny model's first step (no warmup, so it updates) on a random batch, with its params before."""
    cfg = tiny_config("1x1", optimizer__warmup_steps=0)
    layout = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    state = init_state(spec, cfg.model, cfg.seed)
    before = jax.device_get(state["params"])
    batch = jax.device_put(random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size, cfg.seed),
                           batch_sharding(layout))
    state, metrics = make_train_step(spec, layout)(state, batch)
    return cfg, before, jax.device_get(state["params"]), jax.device_get(metrics)


def test_an_optimizer_of_ones_own_trains_and_reports_its_schedule():
    """state_spec(tx=...) takes any optax optimizer. Lion at a constant rate keeps no schedule state (the
    step's lr metric raised "not enough values to unpack"): the schedule given is read at the train step."""
    cfg = tiny_config("2x4")
    layout = make_layout(cfg, parse_mesh("2x4"), devices_for("2x4"))
    schedule = optax.linear_schedule(1e-3, 0.0, 10)
    with pytest.raises(ShardError, match="needs the schedule"):
        state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, tx=optax.lion(1e-3))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, tx=optax.lion(1e-3), schedule=schedule)
    state = init_state(spec, cfg.model, cfg.seed)
    momentum = [x.sharding for x in jax.tree.leaves(state["opt_state"]) if x.ndim]  # Lion's one moment
    assert momentum == [x.sharding for x in jax.tree.leaves(state["params"])]
    batch = jax.device_put(random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size, 0),
                           batch_sharding(layout))
    step = make_train_step(spec, layout)
    state, first = step(state, batch)
    state, second = step(state, batch)
    assert float(first["lr"]) == pytest.approx(1e-3) and float(second["lr"]) == pytest.approx(9e-4)
    assert float(second["loss"]) < float(first["loss"])
    with pytest.raises(ShardError, match="differs from the one the state spec was built with"):
        init_state(spec, cfg.model.__class__(**{**vars(cfg.model), "mlp_dim": 256}), cfg.seed)


def test_the_step_reports_the_mean_loss_and_the_norm_of_the_mean_gradient(one_step):
    """The gradient is divided by the token count before its norm is taken (and before the optimizer,
    clipping and guard.max_grad_norm see it)."""
    cfg, before, _, metrics = one_step
    loss, summed_grads = loss_and_grads(cfg, before)  # the gradient of the summed loss
    tokens = cfg.data.batch * cfg.data.seq_len
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5) and float(metrics["tokens"]) == tokens
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(summed_grads)) / tokens, rel=1e-4)


def test_one_step_lowers_the_loss_on_its_own_batch(one_step):
    """The only absolute check besides the default run's: a step that updated nothing passed every
    layout comparison."""
    cfg, before, after, _ = one_step
    assert float(loss_and_grads(cfg, after)[0]) < float(loss_and_grads(cfg, before)[0]) - 1e-3


def test_microbatches_accumulate_to_the_step_of_one_big_batch(one_step):
    """The same batch in 4 microbatches of 2 rows: the same loss, gradient norm and updated params as in
    one piece (a microbatch dropped or counted twice would change all three)."""
    cfg, before, after, metrics = one_step
    layout = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    state = init_state(spec, cfg.model, cfg.seed)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), before)  # the same start
    batch = jax.device_put(random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size, cfg.seed),
                           batch_sharding(layout))
    state, accumulated = jax.device_get(make_train_step(spec, layout, microbatches=4)(state, batch))
    for key in ("loss", "grad_norm", "tokens"):
        assert float(accumulated[key]) == pytest.approx(float(metrics[key]), rel=1e-5), key
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state["params"], after)


def test_schedule_warms_up_then_decays_to_its_floor():
    _, schedule = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1), total_steps=100)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(55)) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-4)  # half way down the cosine
    assert float(schedule(100)) == pytest.approx(1e-4)


def test_weight_decay_spares_norms_and_vectors():
    """With zero gradients AdamW's update is the decay alone: matrices shrink, norm scales (the stacked
    layers' are 2-D) and vectors stay."""
    tx, _ = make_optimizer(OptimizerConfig(lr=0.5, warmup_steps=0, weight_decay=0.1), total_steps=10)
    params = {"embed": jnp.ones((4, 3)), "final_norm": jnp.ones(3),
              "layers": {"attn_norm": jnp.ones((2, 3)), "wq": jnp.ones((2, 3, 2))}}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.allclose(new["embed"], 1 - 0.5 * 0.1) and np.allclose(new["layers"]["wq"], 1 - 0.5 * 0.1)
    assert np.allclose(new["final_norm"], 1) and np.allclose(new["layers"]["attn_norm"], 1)


def test_gradients_are_clipped_to_the_global_norm_before_adam():
    """Adam's first update is blind to the gradient's scale, so two steps: clipping the first gradient
    (norm 10, clip 1) changes the moments the second update divides by."""
    opt = OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)
    tx, schedule = make_optimizer(opt, total_steps=10)
    reference = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=0.0)
    params = {"w": jnp.ones((2, 2))}
    grads = [{"w": jnp.array([[6.0, 0.0], [8.0, 0.0]])}, {"w": jnp.array([[0.1, 0.3], [0.2, 0.2]])}]
    clipped = [{"w": g["w"] * min(1.0, opt.grad_clip / float(optax.tree.norm(g)))} for g in grads]
    state, ref_state = tx.init(params), reference.init(params)
    for g, c in zip(grads, clipped, strict=True):
        ours, state = tx.update(g, state, params)
        theirs, ref_state = reference.update(c, ref_state, params)
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-6)


@pytest.mark.parametrize("norms, expected", [
    ([1.0] * 10 + [11.0], 11),  # over 10x the median of the ten before it
    ([1.0] * 10 + [9.9], None),
    ([1.0] * 9 + [50.0], None),  # the guard starts at the 11th step
])
def test_the_spike_guard_compares_with_the_median_of_earlier_steps(norms, expected):
    steps = [(i + 1, {"loss": 1.0, "grad_norm": n}) for i, n in enumerate(norms)]
    found = first_divergence(steps, [], GuardConfig(spike_factor=10.0))
    assert (found and found[0]) == expected
    if expected:
        assert "over 10x the median of earlier steps (1)" in found[1]


def test_a_nonfinite_loss_is_divergence_even_without_the_spike_guard():
    assert first_divergence([(1, {"loss": 1.0, "grad_norm": 1.0}), (2, {"loss": math.nan, "grad_norm": 1.0})],
                            [], GuardConfig())[0] == 2


def test_weights_with_a_parameter_the_model_lacks_are_refused():
    cfg = tiny_config("1x1")
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, make_layout(cfg, parse_mesh("1x1"), devices_for("1x1")))
    extra = {**spec.abstract["params"], "unembed": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
    with pytest.raises(ShardError, match=r"parameter unembed \(64, 256\) in the weights is not in the model"):
        spec.check_params_fit(extra, "the weights")


def test_the_batch_must_split_over_microbatches_and_devices():
    cfg = tiny_config("8x1", data__microbatches=2)  # 8 rows: 4 per microbatch, not a multiple of 8 devices
    with pytest.raises(ShardError, match="in each of 2 microbatches"):
        check_batch(cfg, make_layout(cfg, parse_mesh("8x1"), devices_for("8x1")))


def test_top_k_samples_only_the_k_largest():
    logits = jnp.arange(10.0)[::-1][None, :] / 2  # token 0 largest
    drawn = {int(sample(logits, jax.random.key(i), Sampling(top_k=2))[0]) for i in range(200)}
    assert drawn == {0, 1}


def test_evaluation_reads_the_same_held_out_batches_every_time():
    from shard.training.evaluate import Evaluator

    cfg = tiny_config("8x1", eval__every=1, eval__batches=2)
    run = prepare(cfg, devices_for("8x1"))
    evaluator = Evaluator(cfg, run)
    try:
        assert evaluator(run.state["params"]) == evaluator(run.state["params"])
    finally:
        evaluator.close()


def test_a_second_ctrl_c_interrupts_at_once_and_the_handlers_come_back():
    import os
    import signal

    from shard.training.preemption import StopOnSignal

    before = signal.getsignal(signal.SIGINT)
    stopper = StopOnSignal()
    stopper.on_start(None)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the first asks for a stop after this step
        assert stopper.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stopper.on_abort()
    assert signal.getsignal(signal.SIGINT) is before
