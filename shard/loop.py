"""From a resolved config to a trained state: mesh, layout, sharded init, data, compiled step, loop.

Observers (console, metrics.jsonl) receive `on_start(run)`, `on_step(step)`, `on_log(record)` and
`on_end(records)`; the loop itself prints and writes nothing.
"""

import dataclasses
import time
from dataclasses import dataclass

import jax

from shard import distributed
from shard.config import TrainConfig
from shard.data import BatchStream, sample_dataset
from shard.errors import ShardError
from shard.mesh import MeshSpec, build_mesh, parse_mesh, split_over_processes
from shard.rules import Layout
from shard.state import StateSpec, compile_init, init_state, state_spec
from shard.step import abstract_batch, batch_sharding, make_train_step


@dataclass
class Run:
    cfg: TrainConfig
    layout: Layout
    spec: StateSpec
    state: dict
    stream: BatchStream
    step_fn: object  # the compiled step (a jitted function with the MPI bridge)
    compile_s: float | None  # None: compiled on the first call (MPI bridge)

    @property
    def mesh(self):
        return self.layout.mesh


def make_layout(cfg: TrainConfig, mesh_spec: MeshSpec, devices=None) -> Layout:
    """The mesh for these devices, with the preset's rules amended by the config's."""
    mesh = build_mesh(mesh_spec, devices)
    return Layout(
        mesh=mesh,
        rules=mesh_spec.rules | cfg.rules,
        param_rules=mesh_spec.param_rules | cfg.param_rules,
        regex_rules=tuple(cfg.param_regex.items()),
    )


def check_batch(cfg: TrainConfig, layout: Layout) -> None:
    """The (micro)batch must split evenly over the data-parallel devices."""
    dp = layout.degree("batch")
    m = cfg.data.microbatches
    if cfg.data.batch % (dp * m):
        axes = "x".join(f"{a}={layout.axis_sizes[a]}" for a in layout.rules.get("batch", ())
                        if a in layout.axis_sizes)
        per = f" in each of {m} microbatches" if m > 1 else ""
        raise ShardError(
            f"global batch {cfg.data.batch} does not divide over {dp} data-parallel devices ({axes}){per}; "
            f"use a batch that is a multiple of {dp * m}"
        )
    length_ways = layout.degree("length")
    if cfg.data.seq_len % length_ways:
        raise ShardError(f"sequence length {cfg.data.seq_len} does not divide over {length_ways} devices")


def prepare(cfg: TrainConfig, devices=None) -> Run:
    """Everything up to the first step: mesh, shardings, sharded init, data stream, compiled step."""
    ctx = distributed.context()
    if ctx.mode == distributed.MPI:
        return _prepare_bridge(cfg, ctx, devices)
    mesh_spec = parse_mesh(cfg.mesh.spec)
    layout = make_layout(cfg, mesh_spec, devices)
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset = sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout))
    init = compile_init(spec, cfg.model, cfg.seed)
    t0 = time.perf_counter()
    jitted = make_train_step(spec, layout, cfg.data.microbatches)
    abstract_inputs = (spec.abstract_with_shardings(), abstract_batch(layout, cfg.data.batch, cfg.data.seq_len))
    compiled = jitted.lower(*abstract_inputs).compile()
    compile_s = time.perf_counter() - t0
    # Every process compiles first and then meets the others, so the first cross-process computation
    # (the init) starts together.
    distributed.barrier("compiled")
    return Run(cfg, layout, spec, init(), stream, compiled, compile_s)


def _prepare_bridge(cfg: TrainConfig, ctx, devices=None) -> Run:
    """The MPI bridge: a local mesh over this process's devices; processes split the batch axes only
    (parameters are replicated across processes), each reads its own block of every global batch."""
    from shard.bridge import make_bridge_step

    mesh_spec = parse_mesh(cfg.mesh.spec)
    local_devices = list(devices if devices is not None else jax.local_devices())
    dcn, ici = split_over_processes(mesh_spec, len(local_devices), ctx.size)
    layout = make_layout(cfg, dataclasses.replace(mesh_spec, shape=ici), local_devices)
    batch_axes = set(layout.rules.get("batch", ()))
    across = [a for a, d in zip(mesh_spec.axes, dcn) if d > 1]
    if not set(across) <= batch_axes:
        raise ShardError(
            f"--cross-host mpi splits only batch axes across processes, but mesh {mesh_spec.describe()} puts "
            f"{', '.join(across)} across {ctx.size} processes; put a batch axis ({', '.join(sorted(batch_axes))}) "
            "outermost, or use --cross-host xla"
        )
    if cfg.data.batch % ctx.size:
        raise ShardError(f"global batch {cfg.data.batch} does not divide over {ctx.size} processes")
    rows = cfg.data.batch // ctx.size
    check_batch(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch=rows)), layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset = sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout),
                         offset=ctx.rank * rows, rows=rows)
    state = init_state(spec, cfg.model, cfg.seed)  # same seed everywhere: the replicas start equal
    step = make_bridge_step(spec, layout, distributed.world().comm, cfg.data.microbatches,
                            int(cfg.cluster.bucket_mb * (1 << 20)))
    return Run(cfg, layout, spec, state, stream, step, None)


def train(cfg: TrainConfig, *, devices=None, observers=(), run: Run | None = None) -> list[dict]:
    """Run cfg.steps steps; returns the logged records (also sent to the observers)."""
    run = run or prepare(cfg, devices)
    for o in observers:
        getattr(o, "on_start", lambda r: None)(run)
    tokens_per_step = cfg.data.batch * cfg.data.seq_len
    records: list[dict] = []
    start = last_time = time.perf_counter()
    last_step = 0
    state = run.state
    evaluator = None
    if cfg.eval.every:
        from shard.evaluate import Evaluator

        evaluator = Evaluator(cfg, run)
    try:
        for i in range(1, cfg.steps + 1):
            batch = run.stream.next()
            state, metrics = run.step_fn(state, batch)
            for o in observers:
                getattr(o, "on_step", lambda s: None)(i)
            if i % cfg.log_every == 0 or i == cfg.steps:
                values = jax.device_get(metrics)
                now = time.perf_counter()
                elapsed = now - last_time
                record = {
                    "step": i,
                    "loss": float(values["loss"]),
                    "grad_norm": float(values["grad_norm"]),
                    "lr": float(values["lr"]),
                    "tokens_per_s": (i - last_step) * tokens_per_step / elapsed,
                    "step_time_s": elapsed / (i - last_step),
                    "tokens_seen": i * tokens_per_step,
                    "time_s": now - start,
                }
                if evaluator and (i % cfg.eval.every == 0 or i == cfg.steps):
                    eval_loss = evaluator(state["params"])  # None on processes outside the eval set
                    if eval_loss is not None:
                        record["eval_loss"] = eval_loss
                records.append(record)
                for o in observers:
                    getattr(o, "on_log", lambda r: None)(record)
                last_time, last_step = time.perf_counter(), i  # evaluation is not step time
    finally:
        if evaluator:
            evaluator.close()
    run.state = state
    for o in observers:
        getattr(o, "on_end", lambda r: None)(records)
    return records
