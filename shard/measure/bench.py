"""`shard bench collectives`: time each collective over each mesh axis, and report algorithm and bus
bandwidth the way nccl-tests does, so figures compare with `all_reduce_perf` and friends.

Sizes follow nccl-tests: all-reduce, all-to-all and permute move a buffer of `size` bytes per device;
all-gather's output and reduce-scatter's input are `size` bytes. algbw = size / time, and
busbw = algbw x (2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter, all-to-all, 1 for a
permute), the per-link rate a ring achieves. The same code measures simulated CPU devices and NCCL.
"""

from __future__ import annotations

import statistics
import time

from shard.measure.costs import wire_bytes
from shard.measure.hlo import KINDS

def sizes_between(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _collective_fn(kind: str, axis: str, n: int):
    from jax import lax

    if kind == "all-reduce":
        return lambda x: lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: lax.all_gather(x, axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: lax.psum_scatter(x, axis, tiled=True)
    if kind == "all-to-all":
        return lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)
    return lambda x: lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def measure(mesh, kind: str, axis: str, size: int, iters: int = 5, warmup: int = 1) -> dict:
    """Median time of one collective of `size` bytes over one mesh axis, with algbw and busbw (GB/s)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    per_device = size // n if kind == "all-gather" else size
    elems = max(per_device // 4, n)
    elems -= elems % n
    every = tuple(mesh.axis_names)
    spec = P(every)
    fn = jax.jit(jax.shard_map(_collective_fn(kind, axis, n), mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))
    x = jax.device_put(jnp.ones((elems * mesh.size,), jnp.float32), NamedSharding(mesh, spec))
    for _ in range(warmup):
        fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    moved = elems * 4 * (n if kind == "all-gather" else 1)
    algbw = moved / t / 1e9
    return {"kind": kind, "axis": axis, "devices": n, "size_bytes": moved, "asked_bytes": size,
            "time_us": round(t * 1e6, 2),
            "algbw_gbps": _sig(algbw), "busbw_gbps": _sig(algbw * wire_bytes(kind, 1.0, n))}


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def bench(mesh, sizes: list[int], kinds=KINDS, iters: int = 5, on_result=None) -> list[dict]:
    """Every kind over every mesh axis of size > 1, for every size."""
    out = []
    for axis in mesh.axis_names:
        if mesh.shape[axis] < 2:
            continue
        for kind in kinds:
            for size in sizes:
                r = measure(mesh, kind, axis, size, iters)
                out.append(r)
                if on_result:
                    on_result(r)
    return out
