"""The ceiling: how fast a config's train step could run on this machine if everything but its matmuls
were free, then if everything but its matmuls, its optimizer update and its loss's exponentials were.
The step is compiled on each mesh as `shard train` compiles it; every `dot` of its HLO
(shard.measure.hlo_dots: shapes, dtypes, dimension numbers, times run per step) is timed alone.

    python benchmarks/ceiling.py                                  # reference_cpu.toml, fsdp=8 and fsdp=2,model=4
    python benchmarks/ceiling.py --mesh 1x1 --set model.remat=none
    python benchmarks/ceiling.py --quick                          # the tiny model, a few seconds (in the suite)

Each distinct dot is timed after a warm-up, best of its repeats, two ways: alone on one device (on all
the cores, times the mesh's devices, as the step runs one copy per device), and on every device at
once (a shard_map, as the simulated devices share the cores); the faster counts. The sum over dots
of count x time is the step as shard compiles it with nothing but its matmuls. Two floors are added
in turn, each timed alone: the optimizer's update (the state in its shardings, donated, as the step
holds it) and the loss's exponentials, one per logit of the vocabulary (the least a softmax
cross-entropy takes), at the best rate of exp over float32 blocks of 256 rows. The floors are summed
as if none overlapped another. Ceiling tokens/s = the step's tokens / each bound; the ceiling MFU
and HFU divide by the peak `benchmarks/peak.py` cached (shard.hardware.measured_peak). Programs with
dots in a conditional (the table pipeline schedules) are refused: which branch runs is not in the HLO.
Results in docs/performance.md.
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_peak_spec = importlib.util.spec_from_file_location("peak_benchmark", Path(__file__).with_name("peak.py"))
_peak = importlib.util.module_from_spec(_peak_spec)
_peak_spec.loader.exec_module(_peak)
best_seconds = _peak.best_seconds  # the best of repeated calls after a warm-up, as peak.py times matmuls

CONFIG = Path(__file__).with_name("reference_cpu.toml")
DEVICES = 8  # simulated CPU devices, as benchmarks/side_by_side.py runs the reference config
MESHES = ("fsdp=8", "fsdp=2,model=4")
QUICK_SETS = ("model.name=tiny", "data.batch=8", "data.seq_len=32", "model.vocab_size=512")


def fastest_on(devices: int, f, *inputs, min_time: float) -> float:
    """Seconds at best for `devices` copies of `f(*inputs)`: alone on one device times `devices`, or one
    copy on each device at once, whichever is faster."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    alone = jax.jit(f)
    seconds = best_seconds(lambda: jax.block_until_ready(alone(*inputs)), min_time) * devices
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
        stacked = [jax.device_put(jnp.broadcast_to(a, (devices, *a.shape)), NamedSharding(mesh, P("d")))
                   for a in inputs]
        each = jax.jit(jax.shard_map(lambda *xs: f(*(x[0] for x in xs))[None], mesh=mesh,
                                     in_specs=(P("d"),) * len(inputs), out_specs=P("d")))
        seconds = min(seconds, best_seconds(lambda: jax.block_until_ready(each(*stacked)), min_time))
    return seconds


def dot_seconds(dot, devices: int, min_time: float) -> float:
    """Seconds the mesh's `devices` copies of `dot` take at best (`fastest_on`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from shard.measure.hlo_text import NUMPY_NAMES

    dims = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))
    rng = np.random.default_rng(0)

    def operand(dtype_name, shape):
        dtype = jnp.dtype(NUMPY_NAMES[dtype_name])
        values = rng.standard_normal(shape) if jnp.issubdtype(dtype, jnp.floating) else rng.integers(-4, 4, shape)
        return jnp.asarray(values, dtype)

    out = jnp.dtype(NUMPY_NAMES[dot.out_dtype])
    return fastest_on(devices, lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=out),
                      operand(*dot.lhs), operand(*dot.rhs), min_time=min_time)


def optimizer_seconds(cfg, spec, min_time: float) -> float:
    """Seconds the config's optimizer update takes alone on the mesh: gradients of zeros, the state in its
    shardings (`spec`, the step's) and donated, as the step holds it (a step reads and writes the whole
    optimizer state)."""
    import functools

    import jax
    import optax
    from shard.training.state import init_state

    state = init_state(spec, cfg.model, 0)
    held = [spec.trainable(state["params"]), state["opt_state"]]
    grads = jax.tree.map(jax.numpy.zeros_like, held[0])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, grads):
        updates, opt_state = spec.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run():
        held[:] = jax.block_until_ready(update(*held, grads))

    return best_seconds(run, min_time)


def exp_rate(devices: int, vocab: int, min_time: float) -> float:
    """Exponentials a second at best: exp and a row sum over float32 blocks of 256 rows of `vocab`
    (`fastest_on` the devices)."""
    import jax.numpy as jnp

    block = jnp.ones((256, vocab), jnp.float32)
    seconds = fastest_on(devices, lambda x: jnp.sum(jnp.exp(x - 1.0), axis=-1), block, min_time=min_time)
    return devices * block.size / seconds


def ceiling(mesh: str, sets: list[str], min_time: float, top: int) -> dict:
    """The mesh's step compiled, its dots and floors timed; prints the heaviest `top` dots and returns
    the bounds."""
    import jax
    from shard import config, make_layout, parse_mesh
    from shard.config.flops import hardware_flops_per_token, mfu_flops_per_token
    from shard.measure import hlo_dots
    from shard.sharding.mesh import devices_needed
    from shard.training.compiled import compile_step
    from shard.training.state import state_spec

    base = config.load_file(str(CONFIG))
    cfg = config.resolve(config.merge(base, config.nested(config.parse_sets([f"mesh.spec={mesh}", *sets]))))
    spec = parse_mesh(mesh)
    layout = make_layout(cfg, spec, jax.devices()[:devices_needed(spec, len(jax.devices()))])
    devices = layout.mesh.size
    state = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora)  # the step's and the optimizer's
    counted = hlo_dots.dots(compile_step(cfg, layout, state).as_text())
    if any(dot.in_branch for dot in counted):
        raise SystemExit(f"{mesh}: the step has matmuls inside a conditional (a table pipeline schedule's switch), "
                         "which the HLO does not say how often runs; no ceiling for it")
    rows = []
    for dot, count in counted.items():
        s = dot_seconds(dot, devices, min_time)
        rows.append((count * s, count, dot, dot.flops * devices / s))
    rows.sort(key=lambda r: -r[0])
    matmuls_s = sum(r[0] for r in rows)
    optimizer_s = optimizer_seconds(cfg, state, min_time)
    tokens = cfg.data.batch * cfg.data.seq_len
    exps = tokens * cfg.model.vocab_size
    exp_s = exps / exp_rate(devices, cfg.model.padded_vocab, min_time)
    hardware = hardware_flops_per_token(cfg.model, cfg.data.seq_len, "cpu") * tokens
    dtype = cfg.model.compute_dtype_on("cpu")
    print(f"\n{mesh} ({devices} devices, {dtype}, remat {cfg.model.remat_on('cpu')}): {len(rows)} distinct dots, "
          f"{sum(r[1] for r in rows)} per step, {hlo_dots.total_flops(counted) / 1e9:.2f} GFLOP per device "
          f"(shard's hardware count {hardware / devices / 1e9:.2f})")
    print(f"{'share':>6} {'ms/step':>8} {'count':>5} {'GFLOP/s':>8}  dot")
    for t, count, dot, rate in rows[:top]:
        print(f"{t / matmuls_s:6.1%} {t * 1e3:8.1f} {count:5d} {rate / 1e9:8.0f}  {dot.label()}")
    print(f"the optimizer's update alone ({cfg.optimizer.name}): {optimizer_s * 1e3:.1f} ms; the loss's "
          f"{exps / 1e6:,.1f}M exponentials (one per logit) at the best rate: {exp_s * 1e3:.1f} ms")
    bounds = {"matmuls": matmuls_s, "matmuls + optimizer": matmuls_s + optimizer_s,
              "matmuls + optimizer + the loss's exponentials": matmuls_s + optimizer_s + exp_s}
    return {"mesh": mesh, "dtype": dtype, "bounds": bounds, "tokens": tokens,
            "mfu_flops_per_step": mfu_flops_per_token(cfg.model, cfg.data.seq_len) * tokens,
            "hfu_flops_per_step": hardware}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", action="append", help="repeatable; default fsdp=8 and fsdp=2,model=4")
    ap.add_argument("--set", action="append", default=[], help="a config override, repeatable")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds each timing repeats for at least")
    ap.add_argument("--top", type=int, default=8, help="dots listed per mesh")
    ap.add_argument("--quick", action="store_true", help="the tiny model on fsdp=8, 2 repeats: a check, not a figure")
    args = ap.parse_args()
    from shard.startup.devices import request_host_devices

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    request_host_devices(DEVICES)
    sets = [*QUICK_SETS, *args.set] if args.quick else args.set
    min_time = 0.0 if args.quick else args.min_time
    from shard.errors import ShardError

    try:
        results = [ceiling(m, sets, min_time, args.top) for m in args.mesh or (["fsdp=8"] if args.quick else MESHES)]
    except ShardError as e:  # a mesh or a setting that can't run: one line, as shard's commands say it
        raise SystemExit(f"ceiling.py: {e}") from None

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
