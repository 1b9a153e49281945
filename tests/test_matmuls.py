"""The compute-dtype matmul (shard.models.matmuls): on a CPU, bfloat16 matmuls written as float32 and
rounded, forward and backward, with the values and gradients of plain autodiff, and a bfloat16 train
step whose weight matmuls XLA:CPU runs on bfloat16 operands."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard.models import matmuls


def test_the_backward_subscripts_of_a_matmul_and_none_where_it_is_no_plain_one():
    assert matmuls.transposed("btd,dsf->btsf") == ("btsf,dsf->btd", "btd,btsf->dsf")
    assert matmuls.transposed("btnh,nhd->btd") == ("btd,nhd->btnh", "btnh,btd->nhd")
    assert matmuls.transposed("btd,vd->btv") == ("btv,vd->btd", "btd,btv->vd")
    for odd in ("...d,df->...f", "bii,ij->bj", "btd,df", "btdx,df->btf", "a,b,c->abc"):
        assert matmuls.transposed(odd) is None, odd


@pytest.mark.parametrize("subscripts,x_shape,w_shape", [("btd,dsf->btsf", (2, 16, 32), (32, 2, 48)),
                                                        ("btnh,nhd->btd", (2, 16, 4, 8), (4, 8, 32))])
def test_rounded_einsum_gives_plain_autodiff_values_and_gradients_in_bfloat16(subscripts, x_shape, w_shape):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], x_shape, jnp.bfloat16)
    w = jax.random.normal(keys[1], w_shape, jnp.bfloat16)
    out, pull = jax.vjp(lambda a, b: matmuls.einsum(subscripts, a, b), x, w)
    want, want_pull = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), x, w)
    g = jax.random.normal(keys[2], out.shape, jnp.bfloat16)
    for got, ref in zip((out, *pull(g)), (want, *want_pull(g))):
        assert got.dtype == ref.dtype == jnp.bfloat16 and got.shape == ref.shape
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        # the same float32 sums rounded once to bfloat16 (8 bits): at most a rounding step apart
        np.testing.assert_allclose(got, ref, rtol=2**-7, atol=2**-7 * np.abs(ref).max())
    assert jax.default_backend() != "cpu" or matmuls.rounds_float32(jnp.bfloat16)
    assert not matmuls.rounds_float32(jnp.float32)


def test_a_bfloat16_train_step_runs_its_weight_matmuls_on_bfloat16_operands_on_a_cpu():
    """Every dot of the compiled step whose op name is a weight matmul (q/k/v, wo, gate/up, down, the head;
    forward and both backward matmuls) takes bfloat16 operands: XLA:CPU widens a dot that writes
    bfloat16 to float32 (half the speed on its YNNPACK kernels)."""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's dot lowering")
    from shard.measure.hlo_text import parse_module
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.compiled import lower_step

    cfg = tiny_config("1x1", model__compute_dtype="bfloat16", model__remat="full")
    text = lower_step(cfg, make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))).compile().as_text()
    comps, _ = parse_module(text)
    forward = ("btd,dkgh->btkgh", "btnh,nhd->btd", "btd,dsf->btsf", "btf,fd->btd", "btd,vd->btv")  # tiny: tied
    names = {s for f in forward for s in (f, *matmuls.transposed(f))}
    seen = {}
    for comp in comps:
        for ins in comp.instrs.values():
            m = re.search(r'([a-z]+,[a-z]+->[a-z]+)\)*/dot_general"', ins.attrs)
            if ins.opcode == "dot" and m and m.group(1) in names:
                seen.setdefault(m.group(1), []).append([comp.instrs[o].shape.split("[")[0] for o in ins.operands])
    assert set(seen) == names, sorted(names - set(seen))  # forward and both backward matmuls of each
    assert all(ops == ["bf16", "bf16"] for dots in seen.values() for ops in dots), seen
