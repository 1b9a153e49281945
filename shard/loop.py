"""From a resolved config to a trained state: mesh, layout, sharded init, data, compiled step, loop.

Observers (console, metrics.jsonl, checkpoints, signals) may define `on_start(run)`, `on_step(step)`,
`on_log(record)`, `on_state(step, state, data_position, metrics, final)` (after each step, before the
state is donated to the next one), `should_stop()` (asked after each step: stop after it, e.g. on
preemption) and `on_end(records)`; the loop itself prints and writes nothing.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from shard.config import TrainConfig
from shard.data import BatchStream, sample_dataset
from shard.errors import ShardError
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
    start_step: int = 0  # the step the state holds: 0, or the step of the checkpoint resumed from
    stopped_at: int | None = None  # set when an observer's should_stop() ended the loop early

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


def prepare(cfg: TrainConfig, devices=None, restore: Callable | None = None) -> Run:
    """Everything up to the first step: mesh, shardings, sharded init (or `restore(spec)`, which
    returns a shard.checkpoint.Restored in this mesh's shardings), data stream, compiled step."""
    mesh_spec = parse_mesh(cfg.mesh.spec)
    layout = make_layout(cfg, mesh_spec, devices)
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset = sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed)
    if restore is None:
        state, start_step, position = init_state(spec, cfg.model, cfg.seed), 0, 0
    else:
        restored = restore(spec)
        state, start_step, position = restored.state, restored.step, restored.position
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout), position)
    t0 = time.perf_counter()
    jitted = make_train_step(spec, layout, cfg.data.microbatches)
    abstract_inputs = (spec.abstract_with_shardings(), abstract_batch(layout, cfg.data.batch, cfg.data.seq_len))
    compiled = jitted.lower(*abstract_inputs).compile()
    return Run(cfg, layout, spec, state, stream, compiled, time.perf_counter() - t0, start_step)


def train(cfg: TrainConfig, *, devices=None, observers=(), run: Run | None = None) -> list[dict]:
    """Run from run.start_step to cfg.steps (or until an observer asks to stop); returns the logged
    records (also sent to the observers)."""
    run = run or prepare(cfg, devices)
    for o in observers:
        getattr(o, "on_start", lambda r: None)(run)
    tokens_per_step = cfg.data.batch * cfg.data.seq_len
    records: list[dict] = []
    start = last_time = time.perf_counter()
    last_step = run.start_step
    state = run.state
    for i in range(run.start_step + 1, cfg.steps + 1):
        batch = run.stream.next()
        state, metrics = run.step_fn(state, batch)
        # Ask every observer (a list, not a short-circuit): with several processes each one's
        # should_stop() takes part in a collective that all processes must reach.
        stopping = any([getattr(o, "should_stop", lambda: False)() for o in observers])  # noqa: C419
        final = stopping or i == cfg.steps
        for o in observers:
            getattr(o, "on_step", lambda s: None)(i)
        if i % cfg.log_every == 0 or final:
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
            records.append(record)
            for o in observers:
                getattr(o, "on_log", lambda r: None)(record)
            last_time, last_step = now, i
        for o in observers:
            getattr(o, "on_state", lambda *a: None)(i, state, run.stream.position, metrics, final)
        if stopping:
            run.stopped_at = i
            break
    run.state = state
    for o in observers:
        getattr(o, "on_end", lambda r: None)(records)
    return records
