"""From a resolved config to a trained state: mesh, layout, sharded init, data, compiled step, loop.

Observers (console, metrics.jsonl, TensorBoard, profiler) receive `on_start(run)`,
`on_step(step, (state, metrics))` (device values, not yet synced), `on_log(record)` and
`on_end(records)`; the loop itself prints and writes nothing.
"""

import math
import statistics
import time
from dataclasses import dataclass, field

import jax

from shard.config import GuardConfig, TrainConfig
from shard.data import BatchStream, sample_dataset
from shard.errors import DivergenceError, ShardError
from shard.mesh import MeshSpec, build_mesh, parse_mesh
from shard.rules import Layout
from shard.state import StateSpec, init_state, state_spec
from shard.step import abstract_batch, batch_sharding, make_train_step


@dataclass
class Run:
    cfg: TrainConfig
    layout: Layout
    spec: StateSpec
    state: dict
    stream: BatchStream
    step_fn: object  # the compiled step
    compile_s: float
    compiled_memory: dict = field(default_factory=dict)  # per-device bytes from XLA's memory analysis

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def pipeline(self) -> dict:
        """Stages, microbatches, schedule and the computed bubble fraction; empty when not pipelined."""
        stages = self.layout.axis_sizes.get("stage", 1)
        if stages == 1:
            return {}
        from shard.parallel.pipeline import bubble_fraction

        m = self.cfg.pipeline.microbatches
        return {"stages": stages, "microbatches": m, "schedule": self.cfg.pipeline.schedule,
                "bubble": bubble_fraction(stages, m)}


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
    for logical in ("length", "res_length"):
        ways = layout.degree(logical)
        if cfg.data.seq_len % ways:
            axes = "x".join(f"{a}={layout.axis_sizes[a]}" for a in layout.rules.get(logical, ())
                            if a in layout.axis_sizes)
            raise ShardError(f"sequence length {cfg.data.seq_len} does not divide over {ways} devices "
                             f"({axes}, the mesh axes of {logical!r}); use a multiple of {ways}")
    stages = layout.axis_sizes.get("stage", 1)
    if stages > 1:
        from shard.parallel import pipeline

        pipeline.check(cfg.model, stages, cfg.pipeline.microbatches, cfg.data.batch // (dp * m))
    experts = layout.degree("expert", param=True)
    if cfg.model.n_experts % experts if cfg.model.n_experts else False:
        raise ShardError(f"{cfg.model.n_experts} experts do not divide over the expert axis ({experts} ways); "
                         "use a multiple of it for model.n_experts")


def prepare(cfg: TrainConfig, devices=None) -> Run:
    """Everything up to the first step: mesh, shardings, sharded init, data stream, compiled step."""
    mesh_spec = parse_mesh(cfg.mesh.spec)
    layout = make_layout(cfg, mesh_spec, devices)
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset = sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout))
    state = init_state(spec, cfg.model, cfg.seed)
    t0 = time.perf_counter()
    jitted = make_train_step(spec, layout, cfg.data.microbatches, cfg.guard, cfg.pipeline)
    abstract_inputs = (spec.abstract_with_shardings(), abstract_batch(layout, cfg.data.batch, cfg.data.seq_len))
    compiled = jitted.lower(*abstract_inputs).compile()
    return Run(cfg, layout, spec, state, stream, compiled, time.perf_counter() - t0, compiled_memory(compiled))


def compiled_memory(compiled) -> dict:
    """Per-device bytes of the compiled step. CPU's peak ignores temporaries, so peak is computed as
    arguments + temporaries + outputs - aliased (donated) bytes (see JAX-NOTES)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    args, temp = m.argument_size_in_bytes, m.temp_size_in_bytes
    out, alias = m.output_size_in_bytes, m.alias_size_in_bytes
    return {"arguments": args, "temporaries": temp, "outputs": out, "aliased": alias,
            "peak": args + temp + out - alias}


def device_memory(run: Run) -> dict:
    """Memory in use and peak on the busiest local device: measured where the backend reports it,
    else XLA's estimate for the compiled step, labelled as such."""
    stats = [d.memory_stats() for d in run.mesh.local_devices]
    if all(stats):
        return {"mem_in_use_bytes": max(s.get("bytes_in_use", 0) for s in stats),
                "mem_peak_bytes": max(s.get("peak_bytes_in_use", 0) for s in stats), "mem_source": "device"}
    m = run.compiled_memory
    return {"mem_in_use_bytes": m.get("arguments", 0), "mem_peak_bytes": m.get("peak", 0),
            "mem_source": "compiled"}


def first_divergence(steps: list[tuple[int, dict]], history: list[float], guard: GuardConfig):
    """(step, reason) of the first step whose loss or grad norm is not finite or spikes, else None.
    `history` holds earlier steps' grad norms and is extended with the healthy ones."""
    for step, m in steps:
        loss, gnorm = float(m["loss"]), float(m["grad_norm"])
        if not math.isfinite(loss) or not math.isfinite(gnorm):
            return step, f"loss {loss} and gradient norm {gnorm} at step {step}"
        if guard.spike_factor > 0 and len(history) >= 10:
            ref = statistics.median(history[-50:])
            if gnorm > guard.spike_factor * ref:
                return step, (f"gradient norm {gnorm:.3g} at step {step} is over {guard.spike_factor:g}x "
                              f"the median of earlier steps ({ref:.3g})")
        history.append(gnorm)
    return None


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
    pending: list[tuple[int, dict]] = []  # metrics of the steps since the last log, still on device
    grad_norms: list[float] = []
    skipped = 0
    for i in range(1, cfg.steps + 1):
        batch = run.stream.next()
        state, metrics = run.step_fn(state, batch)
        pending.append((i, metrics))
        for o in observers:
            getattr(o, "on_step", lambda s, out: None)(i, (state, metrics))
        if i % cfg.log_every == 0 or i == cfg.steps:
            steps = jax.device_get(pending)
            pending = []
            values = steps[-1][1]
            if cfg.guard.action == "stop":
                bad = first_divergence(steps, grad_norms, cfg.guard)
                if bad:
                    run.state = None  # diverged: nothing downstream may save it
                    raise DivergenceError(f"training diverged: {bad[1]}; stopped, earlier checkpoints are kept")
            else:
                skipped += int(sum(m["skipped"] for _, m in steps))
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
                **device_memory(run),
            }
            if run.pipeline:
                record["pipeline_bubble"] = run.pipeline["bubble"]
            if "aux_loss" in values:
                record["aux_loss"] = float(values["aux_loss"])
            if cfg.guard.action == "skip":
                record["skipped_steps"] = skipped
            records.append(record)
            for o in observers:
                getattr(o, "on_log", lambda r: None)(record)
            last_time, last_step = now, i
    run.state = state
    for o in observers:
        getattr(o, "on_end", lambda r: None)(records)
    return records
