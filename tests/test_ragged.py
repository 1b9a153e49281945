"""The ragged all-to-all: its padded twin, which runs on XLA:CPU, gives `jax.lax.ragged_all_to_all`'s
documented result and gradient; expert-parallel dropless routing through it (the GPU path) and through
XLA:CPU's static all-to-alls equals the experts run on one device, even when every token goes to one
device; on GPUs and TPUs the exchange lowers to the ragged op itself."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from shard.hardware import lowers_ragged_all_to_all
from shard.models import moe
from shard.parallel.expert_exchange import expert_parallel_experts
from shard.parallel.ragged import ragged_all_to_all


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _exchange(n: int, max_send: int, padded: bool = True):
    """The exchange over n devices, each argument stacked over them (device first)."""
    fn = partial(ragged_all_to_all, axis_name="x", max_send=max_send, padded=padded)

    def per_device(*args):
        return fn(*(a[0] for a in args))[None]

    return jax.jit(jax.shard_map(per_device, mesh=_mesh(n), in_specs=P("x"), out_specs=P("x")))


def documented_result(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`jax.lax.ragged_all_to_all`'s docstring, one slice per peer, in numpy (device first)."""
    result = np.array(output)
    n = len(operand)
    for src in range(n):
        for dst in range(n):
            size = send_sizes[src][dst]
            assert size == recv_sizes[dst][src]
            at, start = output_offsets[src][dst], input_offsets[src][dst]
            result[dst][at:at + size] = operand[src][start:start + size]
    return result


def test_the_padded_exchange_gives_the_documented_example():
    # jax.lax.ragged_all_to_all's docstring example, on an axis of 2
    args = [np.array(a, dtype) for a, dtype in (
        ([[1, 2, 2], [3, 4, 0]], np.float32), ([[0, 0, 0, 0], [0, 0, 0, 0]], np.float32),
        ([[0, 1], [0, 1]], np.int32), ([[1, 2], [1, 1]], np.int32), ([[0, 0], [1, 2]], np.int32),
        ([[1, 1], [2, 1]], np.int32))]
    got = _exchange(2, max_send=3)(*args)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def _random_case(n: int, rows: int, width: int, seed: int):
    """Each device sends a random number of rows (up to `rows`) to each, from a shuffled send buffer;
    receivers pack what arrives in source order, after a gap, in front of a filled output."""
    rng = np.random.default_rng(seed)
    send = rng.integers(0, rows + 1, (n, n)).astype(np.int32)  # send[src, dst]
    if seed % 2:
        send[:, 0] = rows  # every device fills one destination's bound
    order = [rng.permutation(n) for _ in range(n)]  # slices in a device's buffer, in any order
    input_offsets = np.zeros((n, n), np.int32)
    for src in range(n):
        at = 0
        for dst in order[src]:
            input_offsets[src, dst] = at
            at += send[src, dst] + 1  # a row of padding between slices
    gap = 2
    output_offsets = (gap + np.cumsum(send, axis=0) - send).astype(np.int32)  # [src, dst] on dst
    operand = rng.normal(size=(n, n * (rows + 1), width)).astype(np.float32)
    output = np.full((n, gap + n * rows + 3, width), 7.0, np.float32)
    return operand, output, input_offsets, send, output_offsets, np.ascontiguousarray(send.T)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_padded_exchange_gives_the_documented_result_and_gradient(seed):
    n, rows = 4, 5
    case = _random_case(n, rows, 3, seed)
    exchange = _exchange(n, max_send=rows)
    np.testing.assert_array_equal(exchange(*case), documented_result(*case))
    # the gradient: a sent row gets the cotangent where it landed, an output row where nothing landed its own
    cot = np.random.default_rng(seed + 10).normal(size=case[1].shape).astype(np.float32)
    _, vjp = jax.vjp(lambda a, b: exchange(a, b, *case[2:]), case[0], case[1])
    d_operand, d_output = vjp(jnp.asarray(cot))
    ids = np.arange(case[0][..., :1].size, dtype=np.float32).reshape(case[0].shape[:2] + (1,))
    landed = documented_result(ids, np.full(case[1].shape[:2] + (1,), -1.0, np.float32), *case[2:])[..., 0]
    want_operand, want_output = np.zeros_like(case[0]), cot.copy()
    for dst in range(n):
        for at, row in enumerate(landed[dst]):
            if row >= 0:
                src, r = divmod(int(row), case[0].shape[1])
                want_operand[src, r] += cot[dst, at]
                want_output[dst, at] = 0
    np.testing.assert_allclose(d_operand, want_operand, rtol=1e-6)
    np.testing.assert_array_equal(d_output, want_output)


def _experts(n_experts: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    D, F = 8, 6
    return (0.3 * jax.random.normal(ks[0], (n_experts, D, F)), 0.3 * jax.random.normal(ks[1], (n_experts, D, F)),
            0.3 * jax.random.normal(ks[2], (n_experts, F, D)))


def _expert_parallel(n: int, exchange: str = "padded-ragged"):
    """expert_parallel_experts over n devices: tokens split over them, experts too."""
    fn = partial(expert_parallel_experts, axes=("x",), exchange=exchange, run_experts=moe.grouped_experts)

    def per_device(*args):
        out, sent = fn(*args)
        return out, sent[None]

    return jax.shard_map(per_device, mesh=_mesh(n), in_specs=(P("x"),) * 6, out_specs=P("x"))


def _output(fn):
    return lambda *args: fn(*args)[0]


def rows_a_ragged_exchange_sends(experts: np.ndarray, n: int, local: int, tokens: int) -> int:
    """Each token once to each other device holding one of its experts (its own device: token // tokens)."""
    return sum(len({int(e) // local for e in row} - {t // tokens}) for t, row in enumerate(experts))


@pytest.mark.parametrize("exchange", ["padded-ragged", "static"])
@pytest.mark.parametrize("skew", ["random", "all-on-one-device", "one-token-everywhere"])
def test_expert_parallel_routing_equals_the_experts_on_one_device(skew, exchange):
    n, E, K, N = 4, 8, 3, 6  # per device: N tokens, E/n experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n * N, 8)), jnp.float32)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(n * N)]).astype(np.int32)
    if skew == "all-on-one-device":  # every choice on device 1: each source fills its bound there
        experts = np.stack([rng.choice([2, 3], 2, replace=False) for _ in range(n * N)]).astype(np.int32)
    elif skew == "one-token-everywhere":  # each token's experts on K different devices
        experts = np.stack([(rng.permutation(n)[:K] * (E // n) + rng.integers(0, E // n)) for _ in range(n * N)])
    experts = jnp.asarray(experts, jnp.int32)
    gates = jnp.asarray(rng.uniform(size=experts.shape), jnp.float32)
    w = _experts(E)

    want = moe.grouped_experts(x, experts, gates, *w)
    got, sent = jax.jit(_expert_parallel(n, exchange))(x, experts, gates, *w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(jnp.sum(sent)) == rows_a_ragged_exchange_sends(np.asarray(experts), n, E // n, N)

    def loss(fn, x, gates, *w):
        return jnp.sum(jnp.sin(fn(x, experts, gates, *w)))

    got_grads = jax.jit(jax.grad(partial(loss, _output(_expert_parallel(n, exchange))), argnums=(0, 1, 2, 3, 4)))(
        x, gates, *w)
    want_grads = jax.grad(partial(loss, moe.grouped_experts), argnums=(0, 1, 2, 3, 4))(x, gates, *w)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_on_gpus_and_tpus_the_exchange_is_the_ragged_op_forward_and_backward():
    """XLA:CPU cannot compile `ragged-all-to-all`, but it lowers: the GPU path is traced, differentiated
    by jax's transpose rule and lowered here, and holds no padded all-to-all of rows."""
    assert lowers_ragged_all_to_all("gpu") and lowers_ragged_all_to_all("tpu") and not lowers_ragged_all_to_all("cpu")
    n, E, K, N = 4, 8, 2, 6
    x = jnp.ones((n * N, 8), jnp.float32)
    experts = jnp.asarray(np.arange(n * N * K).reshape(n * N, K) % E, jnp.int32)
    gates = jnp.ones((n * N, K), jnp.float32)
    w = _experts(E)
    fn = _output(_expert_parallel(n, "ragged"))
    grad = jax.jit(jax.grad(lambda x, *w: jnp.sum(jnp.sin(fn(x, experts, gates, *w))), argnums=(0, 1, 2, 3)))
    text = grad.lower(x, *w).as_text()
    # forward: rows, ids, results; backward: the results' and the rows' cotangents
    assert text.count("ragged_all_to_all") >= 5, text.count("ragged_all_to_all")
    row_width = 8 + K
    assert not [line for line in text.splitlines() if "all_to_all" in line and "ragged" not in line
                and f"x{row_width}x" in line], "a padded all-to-all of rows"
