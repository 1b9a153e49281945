"""The matmuls of a compiled program (shard.measure.hlo_dots), which benchmarks/ceiling.py times."""

import jax
import jax.numpy as jnp

from shard.config.flops import hardware_flops_per_token
from shard.measure import hlo_dots
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.testing import devices_for, tiny_config
from shard.training.compiled import compile_step


def test_a_batched_dot_in_a_loop_counts_its_flops_times_the_trip_count():
    def f(x_bij, w_nbjk):
        return jax.lax.scan(lambda c, w: (c + jnp.einsum("bij,bjk->bik", c, w), None), x_bij, w_nbjk)[0]

    # XLA:CPU writes matmuls of a few elements as element-wise work: these are big enough to stay dots
    text = jax.jit(f).lower(jnp.ones((2, 32, 64)), jnp.ones((5, 2, 64, 64))).compile().as_text()
    counted = hlo_dots.dots(text)
    (dot, n), = counted.items()
    assert n == 5
    assert dot.flops == 2 * 2 * 32 * 64 * 64  # batch 2, rows 32, contracted 64, columns 64
    assert (dot.lhs, dot.rhs, dot.out_dtype) == (("f32", (2, 32, 64)), ("f32", (2, 64, 64)), "f32")
    assert dot.lhs_batch == dot.rhs_batch == (0,) and dot.lhs_contracting == (2,) and dot.rhs_contracting == (1,)
    assert hlo_dots.total_flops(counted) == 5 * dot.flops


def test_the_dots_of_a_train_step_are_the_hardware_flop_count():
    """Every layer's matmuls (the scanned layers' loop counted by its trip count), remat's recompute and the
    head: the count the hardware FLOP share divides by, and at most 5% above it (2.2%: XLA's program
    differs from the formula's in small matmuls). XLA's cost analysis counts the loop's body once;
    counting it once here gives 0.40 of the count."""
    cfg = tiny_config("1x1", model__n_layers=3, model__remat="full")
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    counted = hlo_dots.dots(compile_step(cfg, layout).as_text())
    expected = hardware_flops_per_token(cfg.model, cfg.data.seq_len, "cpu") * cfg.data.batch * cfg.data.seq_len
    assert expected <= hlo_dots.total_flops(counted) <= 1.05 * expected, (hlo_dots.total_flops(counted), expected)


def test_a_dot_in_a_conditionals_branch_is_marked():
    """Which branch runs is not in the HLO: its dots count as if each ran, marked so that a bound on the
    step's time (benchmarks/ceiling.py) can refuse them."""
    def f(flag, x_ij, w_jk):
        return jax.lax.cond(flag, lambda: x_ij @ w_jk, lambda: x_ij) + x_ij @ w_jk

    text = jax.jit(f).lower(True, jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
    assert sorted(dot.in_branch for dot in hlo_dots.dots(text)) == [False, True]
