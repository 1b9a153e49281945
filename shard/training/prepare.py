"""Everything up to a run's first step, from a resolved config: mesh, layout, sharded init (or a restore),
data, the compiled step; under the MPI bridge, a local mesh per process. `prepare` returns the Run that
`shard.training.loop.train` steps through.
"""

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax

from shard.cluster import exchange, process_sets, runtime
from shard.training.compiled import compile_step, memory_of
from shard.config.train import TrainConfig
from shard.data.batches import BatchStream, eval_samples, training_samples
from shard.data.sources import data_source
from shard.errors import ShardError
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh, split_over_processes
from shard.sharding.rules import Layout
from shard.startup.host_memory import release_freed_memory
from shard.training.state import StateSpec, compile_init, init_state, state_spec
from shard.training.step import batch_sharding, check_batch, pipeline_stages, with_schedule

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
    step_hlo: Callable[[], str] | None = None  # the compiled step's HLO text, on demand (the profile's split)
    eval_data: object = None  # the held-out Samples with eval.every (read before compiling: a bad eval.path fails first)

    @property
    def at_step(self) -> int:
        """The step `state` holds: where this start began, or where the last `train` call left it."""
        return self.start_step if self.trained_to is None else self.trained_to

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on up to `step`, this start's at its batch and sequence length; packed rows'
        padding not counted (the stream has made the batches of the steps up to `step`)."""
        if self.stream.packed and step == self.start_step + self.stream.made:
            return self.tokens_before + self.stream.filled_tokens
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
        """Stages, microbatches, schedule and its bubble fraction (read from the schedule's table, which a
        test holds to the formula); empty when not pipelined."""
        stages = pipeline_stages(self.layout)
        if stages == 1:
            return {}
        from shard.parallel.schedule import build

        m, kind, v = self.cfg.pipeline.microbatches, self.cfg.pipeline.schedule, self.cfg.pipeline.virtual_stages
        return {"stages": stages, "microbatches": m, "schedule": kind, "virtual_stages": v,
                "bubble": build(kind, stages, m, v).idle_fraction()}


def prepare(cfg: TrainConfig, devices=None, restore: Callable | None = None, reference: Callable | None = None,
            compiling: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            source=None) -> Run:
    """Everything up to the first step: mesh, shardings, sharded init (or `restore(spec)`, which
    returns a shard.run.checkpoint.Restored in this mesh's shardings), data stream, compiled step.
    `reference(spec)`: where a resumed DPO run reads its reference weights (shard.training.dpo).
    `compiling()` is entered around the step's compile (a line that says so: it can take a minute).
    `source`: the data's description (shard.data.sources.data_source), where the caller has it."""
    ctx = runtime.context()
    if cfg.eval.every:
        from shard.training.evaluate import eval_processes

        eval_processes(cfg, ctx)  # before anything compiles
    if ctx.mode == runtime.MPI:
        return _prepare_bridge(cfg, ctx, devices, restore, source)
    mesh_spec = parse_mesh(cfg.mesh.spec)
    layout = make_layout(cfg, mesh_spec, devices)
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora)
    dataset, eval_data = _training_data(cfg, source)
    if cfg.task == "grpo":  # a missing reward function is said before anything compiles
        from shard.training.rewards import load_rewards

        dataset = dataclasses.replace(dataset, rewards=load_rewards(cfg.grpo.rewards, cfg.grpo.format_pattern))
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
        with compiling():
            t0 = time.perf_counter()
            compiled = compile_step(cfg, layout, spec)
            compile_s = time.perf_counter() - t0
        init = pending_init.result() if pending_init is not None else None
    release_freed_memory()  # what compiling freed, back to the kernel: held by malloc, it stays in the RSS
    exchange.barrier("compiled")
    state, start_step, position, tokens_before, since = _first_state(cfg, spec, init, restore)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout), position)
    hw, peak = device_peak(cfg, layout.mesh.devices.flat[0], layout.mesh.local_mesh.size)
    step_fn = with_schedule(compiled, spec, layout)
    if cfg.task == "grpo":
        from shard.training.rollouts import grpo_run_parts

        stream, step_fn = grpo_run_parts(cfg, spec, layout, compiled, dataset, state, start_step, position, reference)
    if cfg.task == "dpo":
        from shard.training.dpo import frozen_reference, with_reference

        step_fn = with_reference(compiled, spec, layout, frozen_reference(spec, state, start_step, cfg.seed, reference))
    return Run(cfg, layout, spec, state, stream, step_fn, compile_s, memory_of(compiled), peak, hw,
               start_step, tokens_before=tokens_before, held_out_since=since, eval_data=eval_data,
               step_hlo=compiled.as_text)


def _training_data(cfg: TrainConfig, source=None):
    """The training samples, and the held-out ones with eval.every; a mixture whose capped sources hold
    fewer samples than the run reads is refused here, before anything compiles."""
    source = source or data_source(cfg)  # described once, for the training and the held-out samples
    dataset = training_samples(cfg, source)
    total = getattr(dataset, "total", None)  # a mixture of capped sources
    if total is not None and total < cfg.steps * cfg.data.batch:
        raise ShardError(f"the data mixture {cfg.data.path} holds {total:,} samples (its sources' epochs caps), "
                         f"fewer than the {cfg.steps * cfg.data.batch:,} that {cfg.steps} steps of batch "
                         f"{cfg.data.batch} read: raise a cap, or train fewer steps")
    return dataset, _eval_data(cfg, source)


def _eval_data(cfg: TrainConfig, source):
    """The held-out samples an evaluating run reads, or None without evaluation."""
    if not cfg.eval.every:
        return None
    return eval_samples(cfg, source)


def _prepare_bridge(cfg: TrainConfig, ctx, devices=None, restore: Callable | None = None, source=None) -> Run:
    """The MPI bridge: a local mesh over this process's devices; processes split the batch axes only
    (parameters are replicated across processes), each reads its own block of every global batch.
    Every process restores the same checkpoint (process 0 wrote it) into its own mesh."""
    from shard.training.bridge import make_bridge_step

    if cfg.guard.action == "skip":
        raise ShardError("guard.action=skip is not supported with --cross-host mpi yet; use stop")
    if cfg.task in ("dpo", "grpo"):
        raise ShardError(f"task {cfg.task} is not supported with --cross-host mpi yet; use --cross-host xla")
    if cfg.lora.rank:
        raise ShardError("LoRA (lora.rank) is not supported with --cross-host mpi yet; use --cross-host xla")
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
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora)
    dataset, eval_data = _training_data(cfg, source)
    init = (lambda: init_state(spec, cfg.model, cfg.seed)) if restore is None else None  # same seed: equal replicas
    state, start_step, position, tokens_before, since = _first_state(cfg, spec, init, restore)
    stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(layout), position,
                         offset=ctx.rank * rows, rows=rows)
    step = make_bridge_step(spec, layout, process_sets.world().comm, cfg.data.microbatches,
                            int(cfg.cluster.bucket_mb * (1 << 20)), cfg.pipeline)
    hw, peak = device_peak(cfg, layout.mesh.devices.flat[0], layout.mesh.local_mesh.size)
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


def device_peak(cfg: TrainConfig, device, local_devices: int = 1) -> tuple[object, float | None]:
    """(hardware entry, peak FLOP/s per device for the FLOP shares): the user's figure, else the table's
    for GPUs; on a CPU this machine's matmul peak in the step's compute dtype as benchmarks/peak.py
    measured and cached it, shared by the `local_devices` simulated devices that run on it."""
    from shard.hardware import hardware_for_device, measured_peak

    hw = hardware_for_device(getattr(device, "device_kind", ""), device.platform)
    if cfg.observe.peak_tflops > 0:
        return hw, cfg.observe.peak_tflops * 1e12
    if hw is not None and device.platform != "cpu":
        return hw, hw.bf16_tflops * 1e12
    if device.platform == "cpu" and (peak := measured_peak(cfg.model.compute_dtype_on("cpu"))):
        return hw, peak / local_devices
    return hw, None
