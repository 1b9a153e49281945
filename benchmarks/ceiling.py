"""The matmul ceiling: how fast a config's train step could run on this machine if everything but its
matmuls were free. The step is compiled on each mesh as `shard train` compiles it; every `dot` of its
HLO (shard.measure.hlo_dots: shapes, dtypes, dimension numbers, times run per step) is timed alone,
and the sum bounds the step from below, so the model FLOP share (MFU) from above.

    python benchmarks/ceiling.py                                  # reference_cpu.toml, fsdp=8 and fsdp=2,model=4
    python benchmarks/ceiling.py --mesh 1x1 --set model.remat=none
    python benchmarks/ceiling.py --quick                          # the tiny model, a few seconds (in the suite)

Each distinct dot is timed two ways, after a warm-up, best of repeats: alone on one device (using all
the cores, times the mesh's devices, as the step runs one copy per device), and on every device at
once (a shard_map, as the simulated devices share the cores). The faster counts: the ceiling is an
upper bound whichever way XLA:CPU shares the cores. The matmul-bound step time is the sum over dots
of count x time. Two more floors are added in turn: the optimizer's update alone (the state in its
shardings, donated, as the step holds it) and the loss's exponentials, one per logit (the least any
softmax cross-entropy takes), at the best rate of exp over float32 blocks of 256 rows. Ceiling
tokens/s = the step's tokens / each bound; the ceiling MFU and HFU divide by the peak
`benchmarks/peak.py` cached (shard.hardware.measured_peak). A measured MFU above a ceiling means a
count or a timing here is wrong, not that the model is fast. Results in docs/performance.md.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = Path(__file__).with_name("reference_cpu.toml")
DEVICES = 8  # simulated CPU devices, as benchmarks/side_by_side.py runs the reference config
MESHES = ("fsdp=8", "fsdp=2,model=4")
QUICK_SETS = ("model.name=tiny", "data.batch=8", "data.seq_len=32", "model.vocab_size=512")


def best_seconds(f, min_time: float, repeats: int) -> float:
    """The best of `repeats` calls of `f` (more until `min_time` has passed), after one warm-up."""
    f()
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def dot_seconds(dot, devices: int, min_time: float, repeats: int) -> float:
    """Seconds the mesh's `devices` copies of `dot` take at best: alone on one device times `devices`,
    or all at once on every device, whichever is faster."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    dims = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))
    out = jnp.dtype(dot.out_dtype.replace("bf16", "bfloat16").replace("f32", "float32").replace("f16", "float16"))
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}

    def matmul(a, b):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=out)

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal(dot.lhs[1]), dtype[dot.lhs[0]])
    rhs = jnp.asarray(rng.standard_normal(dot.rhs[1]), dtype[dot.rhs[0]])
    alone = jax.jit(matmul)
    t_alone = best_seconds(lambda: alone(lhs, rhs).block_until_ready(), min_time, repeats) * devices
    if devices == 1:
        return t_alone
    mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
    spread = NamedSharding(mesh, P("d"))
    lhs_all, rhs_all = (jax.device_put(jnp.broadcast_to(a, (devices, *a.shape)), spread) for a in (lhs, rhs))
    each = jax.jit(jax.shard_map(lambda a, b: matmul(a[0], b[0])[None], mesh=mesh, in_specs=(P("d"), P("d")),
                                 out_specs=P("d")))
    t_all = best_seconds(lambda: each(lhs_all, rhs_all).block_until_ready(), min_time, repeats)
    return min(t_alone, t_all)


def optimizer_seconds(cfg, layout, min_time: float, repeats: int) -> float:
    """Seconds the config's optimizer update takes alone on the mesh (gradients of zeros, the state in its
    shardings and donated, as the step holds it): a step reads and writes the whole optimizer state."""
    import jax
    import optax
    from shard.training.state import init_state, state_spec

    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    state = init_state(spec, cfg.model, 0)
    params, opt_state = spec.trainable(state["params"]), state["opt_state"]
    grads = jax.tree.map(lambda p: jax.numpy.zeros_like(p), params)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = spec.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    held = [params, opt_state]

    def run():
        held[:] = jax.block_until_ready(update(*held, grads))

    return best_seconds(run, min_time, repeats)


def exp_rate(devices: int, vocab: int, min_time: float, repeats: int) -> float:
    """Exponentials a second at best on this machine: exp and a row sum over float32 blocks of 256 rows
    of `vocab`, alone on one device or on every device at once, whichever is faster."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def softmax_sum(x):
        return jnp.sum(jnp.exp(x - 1.0), axis=-1)

    x = jnp.ones((256, vocab), jnp.float32)
    alone = jax.jit(softmax_sum)
    rate = x.size / best_seconds(lambda: alone(x).block_until_ready(), min_time, repeats)
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
        xs = jax.device_put(jnp.ones((devices, *x.shape), jnp.float32), NamedSharding(mesh, P("d")))
        each = jax.jit(jax.shard_map(softmax_sum, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        rate = max(rate, xs.size / best_seconds(lambda: each(xs).block_until_ready(), min_time, repeats))
    return rate


def ceiling(mesh: str, sets: list[str], min_time: float, repeats: int, top: int) -> dict:
    """The mesh's step compiled, its dots timed; prints the heaviest `top` and returns the figures."""
    import jax
    from shard import config, make_layout, parse_mesh
    from shard.config.flops import hardware_flops_per_token, mfu_flops_per_token
    from shard.measure import hlo_dots
    from shard.sharding.mesh import devices_needed
    from shard.training.compiled import compile_step

    base = config.load_file(str(CONFIG))
    cfg = config.resolve(config.merge(base, config.nested(config.parse_sets([f"mesh.spec={mesh}", *sets]))))
    spec = parse_mesh(mesh)
    layout = make_layout(cfg, spec, jax.devices()[:devices_needed(spec, len(jax.devices()))])
    devices = layout.mesh.size
    counted = hlo_dots.dots(compile_step(cfg, layout).as_text())
    rows = []
    for dot, count in counted.items():
        s = dot_seconds(dot, devices, min_time, repeats)
        rows.append((count * s, count, dot, dot.flops * devices / s))
    rows.sort(key=lambda r: -r[0])
    step_s = sum(r[0] for r in rows)
    optimizer_s = optimizer_seconds(cfg, layout, min_time, repeats)
    tokens = cfg.data.batch * cfg.data.seq_len
    exps = tokens * cfg.model.padded_vocab  # one per logit: the least a softmax cross-entropy takes
    exp_s = exps / exp_rate(devices, cfg.model.padded_vocab, min_time, repeats)
    hardware = hardware_flops_per_token(cfg.model, cfg.data.seq_len, "cpu") * tokens
    dtype = cfg.model.compute_dtype_on("cpu")
    print(f"\n{mesh} ({devices} devices, {dtype}, remat {cfg.model.remat_on('cpu')}): {len(rows)} distinct dots, "
          f"{sum(r[1] for r in rows)} per step, {hlo_dots.total_flops(counted) / 1e9:.2f} GFLOP per device "
          f"(shard's hardware count {hardware / devices / 1e9:.2f})")
    print(f"{'share':>6} {'ms/step':>8} {'count':>5} {'GFLOP/s':>8}  dot")
    for t, count, dot, rate in rows[:top]:
        print(f"{t / step_s:6.1%} {t * 1e3:8.1f} {count:5d} {rate / 1e9:8.0f}  {dot.label()}")
    print(f"the optimizer's update alone ({cfg.optimizer.name}): {optimizer_s * 1e3:.1f} ms; the loss's "
          f"{exps / 1e6:,.1f}M exponentials (one per logit) at the best rate: {exp_s * 1e3:.1f} ms")
    bounds = {"matmuls": step_s, "matmuls + optimizer": step_s + optimizer_s,
              "matmuls + optimizer + the loss's exponentials": step_s + optimizer_s + exp_s}
    return {"mesh": mesh, "dtype": dtype, "bounds": bounds,
            "tokens": tokens, "mfu_flops_per_step": mfu_flops_per_token(cfg.model, cfg.data.seq_len) * tokens,
            "hfu_flops_per_step": hardware}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", action="append", help="repeatable; default fsdp=8 and fsdp=2,model=4")
    ap.add_argument("--set", action="append", default=[], help="a config override, repeatable")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds each timing repeats for at least")
    ap.add_argument("--top", type=int, default=8, help="dots listed per mesh")
    ap.add_argument("--quick", action="store_true", help="the tiny model on fsdp=8, 2 repeats: a check, not a figure")
    args = ap.parse_args()
    from shard.startup.devices import request_host_devices

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    request_host_devices(DEVICES)
    sets = [*QUICK_SETS, *args.set] if args.quick else args.set
    repeats, min_time = (2, 0.0) if args.quick else (args.repeats, args.min_time)
    results = [ceiling(m, sets, min_time, repeats, args.top) for m in args.mesh or (["fsdp=8"] if args.quick else MESHES)]

    from shard.hardware import flop_shares, measured_peak

    print()
    for r in results:
        peak = measured_peak(r["dtype"])
        for what, s in r["bounds"].items():
            line = f"ceiling {r['mesh']}, {what}: {s * 1e3:,.1f} ms a step, {r['tokens'] / s:,.0f} tokens/s"
            if peak:
                mfu, hfu = flop_shares(r["mfu_flops_per_step"] / s, r["hfu_flops_per_step"] / s, peak)
                line += f", MFU {mfu:.1%}, HFU {hfu:.1%} of the {r['dtype']} peak {peak / 1e9:,.1f} GFLOP/s"
            else:
                line += " (no peak cached: run benchmarks/peak.py for the shares)"
            print(line)


if __name__ == "__main__":
    main()
