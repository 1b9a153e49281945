"""From a resolved config to a trained state: mesh, layout, sharded init, data, compiled step, loop.

The loop reports to its observers (`shard.training.observer.Observer`); it prints and writes nothing itself.
"""

import concurrent.futures
import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax

from shard.cluster import exchange, process_sets, runtime
from shard.training.compiled import compile_step, memory_of
from shard.config.model import mfu_flops_per_token
from shard.config.train import GuardConfig, TrainConfig
from shard.data.batches import BatchStream, eval_samples, training_samples
from shard.errors import DivergenceError, ShardError
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh, split_over_processes
from shard.sharding.rules import Layout
from shard.training.observer import Observer
from shard.training.state import StateSpec, compile_init, init_state, state_spec
from shard.training.step import batch_sharding, check_batch, pipeline_stages, with_schedule

# Steps dispatched ahead of the oldest one not yet finished. Enough to keep the devices fed between
# host syncs; unbounded (until --log-every), XLA:CPU's in-process collectives deadlocked with 8
# simulated devices on 2 cores ("Termination timeout ... only 6 of them arrived", then an abort).
MAX_STEPS_AHEAD = 2


@dataclass
class Run:
    cfg: TrainConfig
    layout: Layout
    spec: StateSpec
    state: dict
    stream: BatchStream
    step_fn: object  # the compiled step (a jitted function with the MPI bridge)
    compile_s: float | None  # None: compiled on the first call (MPI bridge)
    compiled_memory: dict = field(default_factory=dict)  # per-device bytes from XLA's memory analysis
    peak_flops: float | None = None  # per device, for MFU (None: unknown, MFU omitted)
    hardware: object = None  # the hardware table's entry for these devices, if any
    start_step: int = 0  # the step the state holds: 0, or the step of the checkpoint resumed from
    stopped_at: int | None = None  # set when an observer's should_stop() ended the loop early
    replicas: int = 1  # processes that each run this mesh (the MPI bridge); 1: the mesh is the whole job
    tokens_before: int = 0  # tokens trained on up to start_step (saved with the checkpoint: seq_len may change)
    trained_to: int | None = None  # the step `state` holds after a `train` (a second call goes on from it)
    held_out_since: int | None = None  # kept in each checkpoint: see shard.run.checkpoint.Restored
    eval_data: object = None  # the held-out Samples with eval.every (read before compiling: a bad eval.path fails first)

    @property
    def at_step(self) -> int:
        """The step `state` holds: where this start began, or where the last `train` call left it."""
        return self.start_step if self.trained_to is None else self.trained_to

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on up to `step`, this start's at its batch and sequence length."""
        return self.tokens_before + (step - self.start_step) * self.cfg.data.batch * self.cfg.data.seq_len

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def devices_in_all(self) -> int:
        """The job's devices: the global mesh's, or under the MPI bridge each process's mesh times N."""
        return self.mesh.size * self.replicas

    @property
    def pipeline(self) -> dict:
        """Stages, microbatches, schedule and the computed bubble fraction; empty when not pipelined."""
        stages = pipeline_stages(self.layout)
        if stages == 1:
            return {}
        from shard.parallel.pipeline import bubble_fraction

        m = self.cfg.pipeline.microbatches
        return {"stages": stages, "microbatches": m, "schedule": self.cfg.pipeline.schedule,
                "bubble": bubble_fraction(stages, m)}


def prepare(cfg: TrainConfig, devices=None, restore: Callable | None = None) -> Run:
    """Everything up to the first step: mesh, shardings, sharded init (or `restore(spec)`, which
    returns a shard.run.checkpoint.Restored in this mesh's shardings), data stream, compiled step."""
    ctx = runtime.context()
    if cfg.eval.every:
        from shard.training.evaluate import eval_processes

        eval_processes(cfg, ctx)  # before anything compiles
    if ctx.mode == runtime.MPI:
        return _prepare_bridge(cfg, ctx, devices, restore)
    mesh_spec = parse_mesh(cfg.mesh.spec)
    layout = make_layout(cfg, mesh_spec, devices)
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset, eval_data = training_samples(cfg), _eval_data(cfg)
    # A helper thread compiles the init while this one traces and compiles the step (XLA compiles
    # without holding the GIL). With one process it also starts the init there, which then runs
    # during the step's compile; with several, every process compiles first and then meets the others,
    # so the first cross-process computation (the init or the restore) starts together.
    alone = jax.process_count() == 1

    def make_init() -> Callable[[], dict]:
        init = compile_init(spec, cfg.model, cfg.seed)
        if not alone:
            return init
        state = init()  # dispatched: runs on the devices while the step compiles
        return lambda: state

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-init") as pool:
        pending_init = pool.submit(make_init) if restore is None else None
        t0 = time.perf_counter()
        compiled = compile_step(cfg, layout, spec)
        compile_s = time.perf_counter() - t0
        init = pending_init.result() if pending_init is not None else None
    exchange.barrier("compiled")
    state, start_step, position, tokens_before, since = _first_state(cfg, spec, init, restore)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout), position)
    hw, peak = device_peak(cfg, layout.mesh.devices.flat[0])
    return Run(cfg, layout, spec, state, stream, with_schedule(compiled, spec, layout), compile_s, memory_of(compiled), peak, hw,
               start_step, tokens_before=tokens_before, held_out_since=since, eval_data=eval_data)


def _eval_data(cfg: TrainConfig):
    """The held-out samples an evaluating run reads, or None without evaluation."""
    if not cfg.eval.every:
        return None
    return eval_samples(cfg)


def _prepare_bridge(cfg: TrainConfig, ctx, devices=None, restore: Callable | None = None) -> Run:
    """The MPI bridge: a local mesh over this process's devices; processes split the batch axes only
    (parameters are replicated across processes), each reads its own block of every global batch.
    Every process restores the same checkpoint (process 0 wrote it) into its own mesh."""
    from shard.training.bridge import make_bridge_step

    if cfg.guard.action == "skip":
        raise ShardError("guard.action=skip is not supported with --cross-host mpi yet; use stop")
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
    if cfg.eval.every:
        from shard.training.evaluate import eval_processes, eval_rows

        eval_rows(cfg, eval_processes(cfg, ctx), layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    dataset, eval_data = training_samples(cfg), _eval_data(cfg)
    init = (lambda: init_state(spec, cfg.model, cfg.seed)) if restore is None else None  # same seed: equal replicas
    state, start_step, position, tokens_before, since = _first_state(cfg, spec, init, restore)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout), position,
                         offset=ctx.rank * rows, rows=rows)
    step = make_bridge_step(spec, layout, process_sets.world().comm, cfg.data.microbatches,
                            int(cfg.cluster.bucket_mb * (1 << 20)), cfg.pipeline)
    hw, peak = device_peak(cfg, layout.mesh.devices.flat[0])
    return Run(cfg, layout, spec, state, stream, step, None, {}, peak, hw, start_step, replicas=ctx.size,
               tokens_before=tokens_before, held_out_since=since, eval_data=eval_data)


def _first_state(cfg: TrainConfig, spec: StateSpec, init: Callable[[], dict] | None,
                 restore: Callable | None) -> tuple[dict, int, int, int, int | None]:
    """(state, its step, the data position, the tokens trained on before it, the step since which the
    held-out data has been held out): `init()`, or else `restore(spec)`. A checkpoint saved before it
    counted its tokens counts its data position at this start's sequence length."""
    if init is not None:
        return init(), 0, 0, 0, 0 if held_out(cfg) else None
    restored = restore(spec)
    tokens = restored.tokens_seen if restored.tokens_seen is not None else restored.position * cfg.data.seq_len
    return restored.state, restored.step, restored.position, tokens, _held_out_since(cfg, restored)


def held_out(cfg: TrainConfig) -> tuple | None:
    """What a config keeps from training for evaluation, as a comparable value; None: nothing."""
    from shard.data.batches import held_out_share

    if cfg.eval.path:
        return ("eval.path", cfg.eval.path)
    share = held_out_share(cfg)
    return ("tail", cfg.data.path, share, cfg.data.seq_len) if share else None


def _held_out_since(cfg: TrainConfig, restored) -> int | None:
    """The held-out data's record carried over a resume: kept when the resumed run holds out the same
    windows, reset to this step when it holds out others (the steps before may have read them)."""
    if held_out(cfg) is None:
        return None
    if not restored.config_toml:  # weights from elsewhere (--init-from): the run starts here
        return 0
    from shard import config
    from shard import tomlfiles

    try:
        before = held_out(config.resolve(tomlfiles.parse(restored.config_toml, "the checkpoint's config")))
    except ShardError:
        before = None
    if before == held_out(cfg):
        return restored.held_out_since  # None for a checkpoint from before this was recorded: unknown
    return restored.step


def device_peak(cfg: TrainConfig, device) -> tuple[object, float | None]:
    """(hardware entry, peak FLOP/s per device for MFU): the user's figure, else the table's for GPUs."""
    from shard.hardware import hardware_for_device

    hw = hardware_for_device(getattr(device, "device_kind", ""), device.platform)
    if cfg.observe.peak_tflops > 0:
        return hw, cfg.observe.peak_tflops * 1e12
    if hw is not None and device.platform != "cpu":
        return hw, hw.bf16_tflops * 1e12
    return hw, None


def device_memory(run: Run) -> dict:
    """Memory in use and peak on the busiest local device: measured where the backend reports it,
    else XLA's estimate for the compiled step, labelled as such."""
    stats = [d.memory_stats() for d in run.mesh.local_devices]
    if all(stats):
        return {"mem_in_use_bytes": max(s.get("bytes_in_use", 0) for s in stats),
                "mem_peak_bytes": max(s.get("peak_bytes_in_use", 0) for s in stats), "mem_source": "device"}
    m = run.compiled_memory
    if not m:  # the MPI bridge compiles on the first call: no estimate to give
        return {}
    return {"mem_in_use_bytes": m["arguments"], "mem_peak_bytes": m["total"], "mem_source": "compiled"}


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
    """Run from run.start_step to cfg.steps (or until an observer asks to stop); returns the logged
    records (also sent to the observers)."""
    for o in observers:
        if not isinstance(o, Observer):
            raise TypeError(f"{type(o).__name__} is not a shard.training.observer.Observer: subclass it")
    run = run or prepare(cfg, devices)
    evaluator = None
    waiting = []  # started and not yet ended, in the order they end: last started first
    try:
        for o in observers:
            o.on_start(run)
            waiting.append(o)
        if cfg.eval.every:
            from shard.training.evaluate import Evaluator

            evaluator = Evaluator(cfg, run)
        records = _run_steps(cfg, run, observers, evaluator)
        while waiting:
            waiting[-1].on_end(records)
            waiting.pop()
    finally:
        if evaluator:
            evaluator.close()
        for o in reversed(waiting):  # an error: the run did not end as planned
            with contextlib.suppress(Exception):  # the error under way is the one to report
                o.on_abort()
    return records


def _run_steps(cfg: TrainConfig, run: Run, observers, evaluator) -> list[dict]:
    tokens_per_step = cfg.data.batch * cfg.data.seq_len
    flops_per_token = mfu_flops_per_token(cfg.model, cfg.data.seq_len)
    records: list[dict] = []
    start = last_time = time.perf_counter()
    first = last_step = run.at_step
    saving_s = 0.0  # time the host spent saving since the last record: not step time
    state = run.state
    pending: list[tuple[int, dict]] = []  # metrics of the steps not yet checked, still on device
    grad_norms: list[float] = []
    skipped = 0
    def asked_to_stop() -> bool:
        # Every observer (a list, not a short-circuit): with several processes each one's should_stop()
        # takes part in a collective that all processes must reach.
        return any([o.should_stop() for o in observers])  # noqa: C419

    def saves(step: int, final: bool) -> bool:
        return any([o.saves_at(step, final) for o in observers])  # noqa: C419

    # asked between eval batches too, where every process evaluates (should_stop is a collective of all)
    eval_stop = None
    if evaluator is not None and len(evaluator.group.ranks) == runtime.context().size:
        eval_stop = asked_to_stop

    def make_record(step: int, values: dict, synced: int | None = None) -> dict:
        """One step's record: its metrics, and speed and memory over the steps since the last record
        (`synced`: the step the host waited for, when later than `step`: the time runs to it)."""
        now = time.perf_counter()
        elapsed, timed = now - last_time - saving_s, (synced or step) - last_step
        record = {
            "step": step,
            "loss": float(values["loss"]),
            "grad_norm": float(values["grad_norm"]),
            "lr": float(values["lr"]),
            "tokens_per_s": timed * tokens_per_step / elapsed,
            "step_time_s": elapsed / timed,
            "tokens_seen": run.tokens_seen(step),
            "time_s": now - start,
            "start_step": run.start_step,  # this start's: 0, or the checkpoint it resumed from
            **device_memory(run),
        }
        if run.peak_flops:
            record["mfu"] = record["tokens_per_s"] * flops_per_token / (run.devices_in_all * run.peak_flops)
        if run.pipeline:
            record["pipeline_bubble"] = run.pipeline["bubble"]
        if "aux_loss" in values:
            record["aux_loss"] = float(values["aux_loss"])
        return record

    def publish(record: dict) -> None:
        records.append(record)
        for o in observers:
            o.on_log(record)

    for i in range(first + 1, cfg.steps + 1):
        batch = run.stream.next()
        state, metrics = run.step_fn(state, batch)
        run.state, run.trained_to = state, i  # kept current: a call that is interrupted leaves a usable run
        pending.append((i, metrics))
        if len(pending) > MAX_STEPS_AHEAD:  # wait for an older step: a bounded queue (see MAX_STEPS_AHEAD)
            jax.block_until_ready(pending[-MAX_STEPS_AHEAD - 1][1])
        stopping = asked_to_stop()
        final = stopping or i == cfg.steps
        for o in observers:
            o.on_step(i, (state, metrics))
        evaluating = evaluator is not None and (i % cfg.eval.every == 0 or i == cfg.steps)
        logging = i % cfg.log_every == 0 or final or evaluating  # an evaluation is logged when it runs
        saving = saves(i, final)
        if logging or saving:
            steps = jax.device_get(pending)
            pending = []
            if cfg.guard.action == "stop":
                bad = first_divergence(steps, grad_norms, cfg.guard)
                if bad:
                    run.state = None  # diverged: nothing downstream may save it
                    # the step that diverged stays on record (metrics.jsonl)
                    publish(make_record(bad[0], dict(steps)[bad[0]], synced=i) | {"diverged": bad[1]})
                    raise DivergenceError(f"training diverged: {bad[1]}; stopped, earlier checkpoints are kept")
            else:
                skipped += int(sum(m["skipped"] for _, m in steps))
        if logging:
            record = make_record(i, steps[-1][1])
            if cfg.guard.action == "skip":
                record["skipped_steps"] = skipped
            if evaluating:
                eval_loss = evaluator(state["params"], eval_stop)  # None on processes outside the eval set
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
            publish(record)
            last_time, last_step, saving_s = time.perf_counter(), i, 0.0  # evaluation is not step time
            # a signal came during it: stop here (the last step ends as it would have, its save the final one)
            if evaluating and evaluator.interrupted and not stopping and i < cfg.steps:
                stopping = final = True
                saving = saves(i, final)
        before = time.perf_counter()
        for o in observers:
            o.on_state(i, state, run.stream.position, metrics, final)
        if saving:  # nor is a checkpoint's blocking part (the device waits: its steps were synced above)
            saving_s += time.perf_counter() - before
        if stopping:
            run.stopped_at = i
            break
    return records
