"""Dropless expert routing per device (shard.models.moe): its hand-written SPMD code.

A sort over tokens split across devices would gather them all (the partitioner cannot split a sort), so
each device routes its own tokens, inside a `jax.shard_map` manual over the mesh axes that split them
(shard.sharding.queries.token_axes): the top-k choice of experts (`per_device_top_k`) and the routed
experts (`dropless_per_device`). The experts' math is the model's (shard.models.moe.grouped_experts),
passed in as `run_experts`.

Under expert parallel (`ep`: the expert axis also splits the tokens) the experts stay split and each
token goes to the devices holding its experts and comes back (`expert_parallel_experts`): by a ragged
all-to-all where the platform lowers one (shard.parallel.ragged), by static all-to-alls of every token
to every device where it does not (XLA:CPU). Experts split over an axis that holds the same tokens are
gathered at the shard_map's boundary instead, as FSDP gathers a weight.

Letters as in shard.models.moe: B batch, T length, D embed, E experts, F mlp, K experts per token, N
tokens, M = N K (token, choice) pairs.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shard.hardware import lowers_ragged_all_to_all
from shard.parallel.ragged import ragged_all_to_all
from shard.sharding.queries import expert_split_axes, layout_platform, token_axes
from shard.sharding.rules import active_layout


def per_device_top_k(scores_bte: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the experts, each device on its own tokens: left to the partitioner, the
    scores of every token device were all-gathered to be sorted (moe-fine-tiny on `ep`: 57 KB a step
    over data x expert, a quarter of the expert axis' traffic beyond the all-to-alls)."""
    batch, length = token_axes()
    if not batch and not length:
        return jax.lax.top_k(scores_bte, k)
    spec = P(batch or None, length or None)
    fn = jax.shard_map(lambda s: tuple(jax.lax.top_k(s, k)), mesh=active_layout().mesh, in_specs=spec,
                       out_specs=(spec, spec), axis_names=set(batch + length))
    return fn(scores_bte)


def expert_exchange(platform: str) -> str:
    """How dropless routing's tokens move under expert parallel (`expert_parallel_experts`) on `platform`:
    "ragged" by `jax.lax.ragged_all_to_all` (GPUs, TPUs); "static" by all-to-alls of every token to
    every device (XLA:CPU, which has no ragged all-to-all). A third, "padded-ragged", is the ragged path
    with the op's padded twin (`shard.parallel.ragged`), which runs it on XLA:CPU: the tests' way to
    check the GPU path (it moves the static bytes, more slowly)."""
    return "ragged" if lowers_ragged_all_to_all(platform) else "static"


def dropless_per_device(h_btd, gates_btk, experts_btk, weights: tuple, run_experts) -> tuple[jax.Array, jax.Array]:
    """The routed experts' output (B, T, D), no token dropped, each device on its own tokens, and the
    token rows sent to other devices of the expert axis (all devices; 0 without expert parallel).
    `weights`: the experts' (w_gate, w_up, w_down) in the compute dtype; `run_experts(x_nd, experts_nk,
    gates_nk, *weights)`: the experts on one device's tokens (shard.models.moe.grouped_experts)."""
    D, K = h_btd.shape[-1], experts_btk.shape[-1]
    batch, length = token_axes()
    experts = expert_split_axes(batch + length) if batch or length else ()
    exchange = expert_exchange(layout_platform()) if experts else "static"

    def local(h_btd, gates_btk, experts_btk, *w):
        b, t = h_btd.shape[:2]
        args = (h_btd.reshape(b * t, D), experts_btk.reshape(b * t, K), gates_btk.reshape(b * t, K), *w)
        if not experts:
            return run_experts(*args).reshape(b, t, D), jnp.zeros((), jnp.float32)
        out_nd, sent = expert_parallel_experts(*args, experts, exchange, run_experts=run_experts)
        return out_nd.reshape(b, t, D), jax.lax.psum(sent, batch + length)

    if not batch and not length:
        return local(h_btd, gates_btk, experts_btk, *weights)
    spec = P(batch or None, length or None)
    # Experts split over an axis that also splits the tokens (`ep`) enter split, and tokens move to them
    # by all-to-all; over any other axis they are gathered at the boundary, their gradients reduced
    # back: every device runs every expert on its own tokens.
    w_spec = P(experts) if experts else P()
    fn = jax.shard_map(local, mesh=active_layout().mesh, in_specs=(spec, spec, spec, w_spec, w_spec, w_spec),
                       out_specs=(spec, P()), axis_names=set(batch + length))
    return fn(h_btd, gates_btk, experts_btk, *weights)


def expert_parallel_experts(x_nd, experts_nk, gates_nk, w_gate_edf, w_up_edf, w_down_efd,
                            axes: tuple[str, ...], exchange: str, *, run_experts) -> tuple[jax.Array, jax.Array]:
    """Dropless routing with the experts split over the manual mesh `axes` (this device holds E/n of
    them): tokens go to the devices that hold their experts, with their k expert ids and gates; there
    `run_experts` (shard.models.moe.grouped_experts) runs the choices that device holds (its own
    experts' ids) and their gated sum comes back, summed per token. `exchange` (`expert_exchange`) says
    how they move: each token once to each device holding one of its experts (ragged: about N r rows a
    device each way, r the other devices a token's experts live on, `costs.dropless_remote_devices`), or
    every token to every device (static: (n-1) N rows, the fewest static buffers that drop nothing can
    hold). Returns the output (N, D) and the rows a ragged exchange sends from this device to others
    (float32), whichever ran."""
    n = jax.lax.psum(1, axes)
    local = w_gate_edf.shape[0]  # experts on this device
    me = jax.lax.axis_index(axes)
    to_jn = jnp.any((experts_nk // local)[None] == jnp.arange(n)[:, None, None], axis=-1)  # token n goes to j
    sent = (jnp.sum(to_jn) - jnp.sum(to_jn[me])).astype(jnp.float32)
    on_device = partial(_local_experts, weights=(w_gate_edf, w_up_edf, w_down_efd), first=local * me,
                        run_experts=run_experts)
    if exchange == "static":
        out_nd = _static_exchange(x_nd, experts_nk, gates_nk, on_device, axes, n)
    else:
        out_nd = _ragged_exchange(x_nd, experts_nk, gates_nk, on_device, axes, to_jn, exchange == "padded-ragged")
    return out_nd, sent


def _local_experts(rows_mc, ids_mk, *, weights, first: jax.Array, run_experts) -> jax.Array:
    """`run_experts` on the received rows (D values then K gates) for the choices this device holds,
    experts first .. first + local - 1; choices held elsewhere (and empty rows, ids < 0) get group
    `local`, past the last group: sorted to the end, ragged_dot leaves them zero, and their gate is zero."""
    K, local = ids_mk.shape[-1], weights[0].shape[0]
    ids_mk = ids_mk - first
    mine_mk = (ids_mk >= 0) & (ids_mk < local)
    return run_experts(rows_mc[:, :-K], jnp.where(mine_mk, ids_mk, local), jnp.where(mine_mk, rows_mc[:, -K:], 0),
                       *weights)


def _static_exchange(x_nd, experts_nk, gates_nk, on_device, axes, n: int) -> jax.Array:
    """Every token to every device of `axes` (n of them) and the results back, by static all-to-alls;
    `on_device(rows, ids)`: this device's experts on what it received (`_local_experts`)."""
    N, K = experts_nk.shape
    rows_jnc = jnp.broadcast_to(jnp.concatenate([x_nd, gates_nk.astype(x_nd.dtype)], -1), (n, N, x_nd.shape[-1] + K))
    ids_jnk = jnp.broadcast_to(experts_nk.astype(jnp.int32), (n, N, K))
    rows_jnc = jax.lax.all_to_all(rows_jnc, axes, 0, 0)  # now (source, N, .): what each source sent here
    ids_jnk = jax.lax.all_to_all(ids_jnk, axes, 0, 0)
    y_md = on_device(rows_jnc.reshape(n * N, -1), ids_jnk.reshape(n * N, K))
    y_jnd = jax.lax.all_to_all(y_md.reshape(n, N, -1), axes, 0, 0)  # (destination, N, D), back home
    return jnp.sum(y_jnd, axis=0)


def _ragged_exchange(x_nd, experts_nk, gates_nk, on_device, axes, to_jn, padded: bool) -> jax.Array:
    """Each token once to each device `to_jn` names (j, N) and the results back, by ragged all-to-alls;
    `on_device(rows, ids)`: this device's experts on what it received (`_local_experts`).

    The send buffer is destination-major: the tokens bound for device j (at most N) are rows
    start_j .. start_j + send_j, in token order. On a receiver, source i's rows land at i N, so its
    buffers hold every source's every token (n N rows, the dropless worst case) and rows no source
    filled carry no expert (id -1)."""
    N, K = experts_nk.shape
    n = to_jn.shape[0]
    send_j = jnp.sum(to_jn, axis=1, dtype=jnp.int32)
    start_j = jnp.cumsum(send_j) - send_j
    row_jn = jnp.where(to_jn, start_j[:, None] + jnp.cumsum(to_jn, axis=1) - 1, n * N)
    token_r = jnp.full((n * N,), N, jnp.int32).at[row_jn.reshape(-1)].set(
        jnp.tile(jnp.arange(N, dtype=jnp.int32), n), mode="drop")  # the token of each send row; N: none
    rows_nc = jnp.concatenate([x_nd, gates_nk.astype(x_nd.dtype)], -1)
    rows_rc = jnp.take(rows_nc, token_r, axis=0, mode="fill", fill_value=0)
    ids_rk = jnp.take(experts_nk.astype(jnp.int32), token_r, axis=0, mode="fill", fill_value=-1)
    recv_i = jax.lax.all_to_all(send_j, axes, 0, 0, tiled=True)  # rows each source sends here
    slot_j = jnp.full((n,), jax.lax.axis_index(axes) * N, jnp.int32)  # where this device's rows go on each
    exchange = partial(ragged_all_to_all, axis_name=axes, max_send=N, padded=padded)
    got_mc = exchange(rows_rc, jnp.zeros_like(rows_rc), start_j, send_j, slot_j, recv_i)
    ids_mk = exchange(ids_rk, jnp.full_like(ids_rk, -1), start_j, send_j, slot_j, recv_i)
    y_md = on_device(got_mc, ids_mk)
    home_i = jax.lax.all_to_all(start_j, axes, 0, 0, tiled=True)  # where source i's rows came from there
    back_rd = exchange(y_md, jnp.zeros_like(y_md), jnp.arange(n, dtype=jnp.int32) * N, recv_i, home_i, send_j)
    return jax.ops.segment_sum(back_rd, token_r, num_segments=N)  # row N (no token) is dropped
