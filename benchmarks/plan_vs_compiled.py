"""The planner against the compiler at scale: the train step of llama-13b-24l AOT-compiled from shapes
(nothing allocated) on 32, 256 and 1024 simulated CPU devices, with and without a stage axis, and per
case the planner's per-device memory and bytes per mesh axis (shard.measure.memory.memory_bytes,
shard.measure.costs.comm_bytes: the functions `shard plan` ranks by) beside the compiled ones (XLA's
memory analysis; the logical collective bytes shard's HLO readers count, as `shard inspect --compiled`
does), and their ratio. The goal (issue 54) is within 10% in float32, where XLA:CPU keeps the dtypes a
GPU would. Each case runs in a fresh process: XLA reads the device count once.

    python benchmarks/plan_vs_compiled.py [--devices 32,256,1024] [--dtype float32] [--only nostage|stage]

A case is `(devices, mesh, global batch)`; the batch keeps 4 rows of 2048 tokens per batch way (data x
fsdp), the reference's 64 on data=2,fsdp=8,model=2. Stage cases run 8 microbatches (`--microbatches`).
Under the table schedules (1F1B) the collectives inside the schedule's `lax.switch` count on every tick,
so those axes' compiled bytes are upper bounds (marked), beside the count with each branch weighed by
the (tick, stage) slots that run it and the sends by the schedule table (analysis.table_exact_bytes). Results are in docs/measuring.md.
"""

import argparse
import json
import os
import subprocess
import sys

from shard.startup.devices import with_host_devices

# 1F1B (and zero_bubble) on a mesh with stage, fsdp and model together aborts XLA:CPU's SPMD partitioner
# (jax 0.10.2: "Check failed: partition_group_list.num_replica_groups() * ..."; GPipe compiles), so the
# 1F1B cases take stage with data and one of fsdp and model, and GPipe takes all four
CASES = [  # (devices, mesh, batch, pipeline schedule)
    (32, "data=2,fsdp=8,model=2", 64, "1f1b"),
    (32, "stage=4,data=4,model=2", 64, "1f1b"),
    (32, "stage=4,data=2,fsdp=4", 64, "1f1b"),
    (32, "stage=4,data=2,fsdp=2,model=2", 64, "gpipe"),
    (256, "data=16,fsdp=8,model=2", 512, "1f1b"),
    (256, "stage=4,data=32,model=2", 512, "1f1b"),
    (256, "stage=4,data=8,fsdp=8", 512, "1f1b"),
    (1024, "data=64,fsdp=8,model=2", 2048, "1f1b"),
    (1024, "stage=4,data=128,model=2", 2048, "1f1b"),
    (1024, "stage=4,data=32,fsdp=8", 2048, "1f1b"),
]

CASE = r"""
import json, sys, time
t0 = time.perf_counter()
from shard import config, make_layout, parse_mesh
from shard.measure import costs, hlo
from shard.measure.analysis import analyze, table_exact_bytes
from shard.measure.memory import memory_bytes
mesh, batch, seq, dtype, micro, schedule = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
cfg = config.resolve(config.parse_sets([
    "model.name=llama-13b-24l", f"mesh.spec={mesh}", f"data.seq_len={seq}", f"data.batch={batch}",
    "data.path=synthetic", f"model.compute_dtype={dtype}", "model.remat=full",
    f"pipeline.schedule={schedule}", f"pipeline.microbatches={micro}"]))
layout = make_layout(cfg, parse_mesh(mesh))
a = analyze(cfg, layout)
shape = costs.LayoutShape.from_layout(layout)
work = costs.Workload.from_config(cfg, "cpu")  # as the analysis reads the minimum: the CPU's dtypes
sizes = dict(layout.axis_sizes)
# Collectives in a conditional's branches (the table schedules' lax.switch) count on every tick: the
# compiled bytes of their axes are upper bounds; table_exact_bytes counts them as the table runs them.
branch = hlo.bytes_by_axes([c for c in a.collectives if c.in_branch], axis_sizes=sizes)
exact = table_exact_bytes(a, cfg, sizes)
print(json.dumps({"planned_memory": memory_bytes(cfg.model, shape, work),
                  "planned_bytes": costs.comm_bytes(cfg.model, shape, work),
                  "compiled_memory": a.memory, "compiled_bytes": a.bytes_by_axes, "upper_bounds": branch,
                  "exact_bytes": exact, "seconds": time.perf_counter() - t0}))
"""


def run_case(devices: int, mesh: str, batch: int, seq: int, dtype: str, micro: int, schedule: str) -> dict:
    """One compile in a fresh process on `devices` simulated CPU devices; {"error": text} when it fails."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=with_host_devices(os.environ.get("XLA_FLAGS", ""), devices))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # 13B programs: not worth the disk
    out = subprocess.run([sys.executable, "-c", CASE, mesh, str(batch), str(seq), dtype, str(micro), schedule],
                         env=env, capture_output=True, text=True, check=False)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (out.stderr or out.stdout)[-2000:]}


def _ratio(planned: float, compiled: float) -> str:
    return f"{planned / compiled:.3f}" if compiled else ("1" if not planned else "inf")


def report(devices: int, mesh: str, batch: int, schedule: str, r: dict) -> list[str]:
    """Lines of one case: memory, then each axis, planned, compiled and planned/compiled."""
    head = f"{devices:>5}  {mesh:<30} {schedule if 'stage=' in mesh else '':<5} batch {batch:<5}"
    if "error" in r:
        return [f"{head} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"]
    gib = 1024**3
    pm, cm = r["planned_memory"]["total"], r["compiled_memory"]["total"]
    lines = [f"{head} memory/device  planned {pm / gib:8.2f} GiB  compiled {cm / gib:8.2f} GiB  "
             f"ratio {_ratio(pm, cm)}  ({r['seconds']:.0f}s)"]
    for axis in sorted(set(r["planned_bytes"]) | set(r["compiled_bytes"])):
        p, c = r["planned_bytes"].get(axis, 0.0), r["compiled_bytes"].get(axis, 0.0)
        note = ""
        if r["upper_bounds"].get(axis):  # compiled in the switch's branches: counted as the table runs them
            exact = r["exact_bytes"].get(axis, 0.0)
            note = f"  (upper bound; as the table runs: {exact / gib:.2f} GiB, ratio {_ratio(p, exact)})"
        lines.append(f"{'':>52}{axis:<8} planned {p / gib:8.2f} GiB  compiled {c / gib:8.2f} GiB  "
                     f"ratio {_ratio(p, c)}{note}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="32,256,1024")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--only", choices=("nostage", "stage"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", help="also write every case's figures to this file")
    args = ap.parse_args()
    wanted = {int(d) for d in args.devices.split(",")}
    cases = [c for c in CASES if c[0] in wanted and (args.only is None or ("stage=" in c[1]) == (args.only == "stage"))]
    results, failed = [], 0
    print(f"llama-13b-24l, {args.dtype}, remat full, seq {args.seq}; planned / compiled per device per step")
    for devices, mesh, batch, schedule in cases:
        r = run_case(devices, mesh, batch, args.seq, args.dtype, args.microbatches, schedule)
        failed += "error" in r
        results.append({"devices": devices, "mesh": mesh, "batch": batch, "schedule": schedule, **r})
        print("\n".join(report(devices, mesh, batch, schedule, r)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed == len(cases) else 0


if __name__ == "__main__":
    sys.exit(main())
