"""`shard plan`: enumerate the layouts of a model on a cluster, predict their memory, communication,
step time and MFU with the analytic model (shard.measure.costs), and rank them.

Pure Python: no JAX, nothing compiled. The predictions are checked against compiled steps by
tests/test_plan.py on simulated devices.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field

from shard.measure import costs
from shard.measure.flops import fp8_matmul_params, model_flops
from shard.measure.memory import hbm_bytes, memory_bytes, optimizer_bytes, probs_hbm_bytes
from shard.measure.schedules import pipeline_choices
from shard.parallel.schedule import build
from shard.axes import BATCH, CONTEXT, DATA, EXPERT_AXIS, FSDP, LENGTH, MODEL, STAGE
from shard.errors import ShardError
from shard.hardware import Hardware
from shard.sharding.mesh import hosts_per_axis
from shard.config.model import ModelConfig
from shard.config.flops import mfu_flops_per_token
from shard.config.precision import fp8_gathered

GIB = 1024**3
USABLE_HBM = 0.9  # leave a tenth of HBM for the runtime, communication buffers and fragmentation
MEMORY_MODEL_LOW = 0.09  # the memory model runs up to 8.7% low (docs/formulas.md): closer to the limit is "tight"
REMAT_CHOICES = ("none", "full")
MAX_STAGES = 16  # deeper pipelines need M >= S microbatches of a batch few runs have
def startup_warnings(cfg, sizes: dict[str, int], hw: Hardware, hosts: int) -> list[str]:
    """Warnings for layouts known to be communication-bound, with the numbers: an axis whose traffic
    takes longer than the step's compute (per-device token batch below the break-even), or tensor
    parallelism that leaves too thin a slice of the MLP per device."""
    out = []
    if costs.unmodelled_axes(costs.LayoutShape.of(**sizes), moe=bool(cfg.model.n_experts)):  # as predict() plans
        return out  # the cost model has no formulas for pipeline or expert axes, or Megatron-SP, yet
    c = predict(cfg.model, sizes, cfg.model.remat, hw, hosts, cfg.data.batch, cfg.data.seq_len)
    tokens_per_device = cfg.data.batch * cfg.data.seq_len / math.prod(sizes.values())
    for axis, t in sorted(c.comm_s.items()):
        if axis != MODEL and t > c.compute_s > 0:
            where = "across hosts" if c.crosses_nodes.get(axis) else "in a node"
            out.append(
                f"communication-bound on {axis}: {c.comm_bytes[axis] / 1e6:,.1f} MB per device per step "
                f"({t * 1e3:.2f} ms {where} on {hw.name}) vs {c.compute_s * 1e3:.2f} ms of compute; "
                f"{tokens_per_device:,.0f} tokens per device is below the break-even of about "
                f"{tokens_per_device * t / c.compute_s:,.0f}: raise the batch or shrink the {axis} axis")
    tp = sizes.get(MODEL, 1)
    if tp > 1 and cfg.model.mlp_dim // tp < MIN_MLP_SLICE:
        out.append(f"tensor parallel over {tp} devices leaves {cfg.model.mlp_dim // tp} MLP columns per device "
                   f"(under {MIN_MLP_SLICE}): matmuls too thin to hide its all-reduces; use fewer model ways")
    return out


MIN_MLP_SLICE = 256


@dataclass(frozen=True)
class Candidate:
    """One layout's predicted costs per device per step."""

    sizes: dict[str, int]
    remat: str
    memory: dict[str, float]  # bytes: params, grads, optimizer, gathered, activations, total
    comm_bytes: dict[str, float]  # per mesh axis
    comm_s: dict[str, float]  # per mesh axis
    crosses_nodes: dict[str, bool]
    compute_s: float
    hbm_s: float
    step_s: float  # compute/HBM roofline, data-parallel traffic overlapped, tensor parallel exposed
    step_s_serial: float  # nothing overlapped
    mfu: float
    tokens_per_s: float
    problems: tuple[str, ...] = field(default=())  # why it does not fit
    # the data-parallel devices the global batch does not split over (one of the problems); None: it splits
    unsplit_batch_ways: int | None = None
    # with a stage axis: schedule, microbatches, virtual_stages and its bubble (idle share of the step)
    pipeline: dict | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    def mesh_spec(self) -> str:
        used = {a: n for a, n in self.sizes.items() if n > 1} or {DATA: 1}
        return ",".join(f"{a}={n}" for a, n in used.items())

    def label(self) -> str:
        """The mesh, and its pipeline schedule with microbatches (and virtual stages) where it has one."""
        if not self.pipeline:
            return self.mesh_spec()
        p = self.pipeline
        return (f"{self.mesh_spec()} {p['schedule']} M={p['microbatches']}"
                + (f" V={p['virtual_stages']}" if p["virtual_stages"] > 1 else ""))

    def command(self, model: str, batch: int, seq: int, sets: tuple[str, ...] = ()) -> str:
        """The `shard train` command for this layout; `sets`: the plan's own `--set key=value` items
        (model changes), passed on so the command trains the model that was planned."""
        cmd = f"shard train --model {model} --mesh {self.mesh_spec()} --batch {batch} --seq {seq}"
        cmd += "".join(f" --set {shlex.quote(item)}" for item in sets)
        if self.pipeline:
            cmd += "".join(f" --set pipeline.{k}={self.pipeline[k]}" for k in ("schedule", "microbatches", "virtual_stages")
                           if k != "virtual_stages" or self.pipeline[k] > 1)
        return cmd + f" --set model.remat={self.remat}"  # named: "auto" differs by machine

    def to_dict(self) -> dict:
        return {
            "mesh": self.mesh_spec(), "sizes": self.sizes, "remat": self.remat, "fits": self.fits,
            "problems": list(self.problems), "memory_per_device_bytes": int(self.memory["total"]),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "comm_bytes_per_axis": {k: int(v) for k, v in self.comm_bytes.items()},
            "comm_s_per_axis": {k: round(v, 6) for k, v in self.comm_s.items()},
            "crosses_nodes": self.crosses_nodes, "compute_s": round(self.compute_s, 6),
            "hbm_s": round(self.hbm_s, 6), "step_s": round(self.step_s, 6),
            "step_s_no_overlap": round(self.step_s_serial, 6), "mfu": round(self.mfu, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "pipeline": self.pipeline and {**self.pipeline, "bubble": round(self.pipeline["bubble"], 4)},
        }


def node_split(sizes: dict[str, int], nodes: int) -> dict[str, int]:
    """How many nodes each mesh axis spans, `sizes` given outermost first: nodes fill the outermost axes
    first (mesh.hosts_per_axis, as build_mesh does)."""
    spans = hosts_per_axis(tuple(sizes.values()), nodes)
    if spans is None:
        raise ShardError(f"mesh {sizes} cannot be split over {nodes} nodes")
    return dict(zip(sizes, spans))


def layouts(devices: int, per_node: int, seq_len: int | None = None, experts: int = 0) -> list[dict[str, int]]:
    """Every data x fsdp x context x model factorisation of `devices` with tensor parallel inside a node
    and a context axis that splits `seq_len` (none when it is not given), outermost axis first. For a
    mixture of `experts`, every data x fsdp x expert one with the expert axis splitting the experts
    (and the batch, as in shard/meshes/ep.toml): tensor and context parallel have no formula for its layers."""
    if experts:
        return [{DATA: devices // expert // fsdp, FSDP: fsdp, EXPERT_AXIS: expert}
                for expert in _divisors(devices) if experts % expert == 0
                for fsdp in _divisors(devices // expert)]
    out = []
    for model in _divisors(devices):
        if per_node % model:
            continue
        for fsdp in _divisors(devices // model):
            for context in _divisors(devices // model // fsdp) if seq_len else (1,):
                if seq_len and seq_len % context:
                    continue
                sizes = {DATA: devices // model // fsdp // context, FSDP: fsdp, CONTEXT: context, MODEL: model}
                out.append(sizes if seq_len else {a: n for a, n in sizes.items() if a != CONTEXT})
    return out


def pipeline_layouts(devices: int, per_node: int, n_layers: int) -> list[dict[str, int]]:
    """Every stage x data x fsdp x model factorisation of `devices` with at least 2 stages that split the
    `n_layers` layers (at most `MAX_STAGES`), the stage axis outermost (across nodes first: a stage boundary passes one microbatch's
    activations, where tensor parallel all-reduces every layer's) and tensor parallel inside a node."""
    return [{STAGE: s, **sizes} for s in _divisors(devices) if 1 < s <= MAX_STAGES and n_layers % s == 0
            for sizes in layouts(devices // s, per_node)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def predict(cfg: ModelConfig, sizes: dict[str, int], remat: str, hw: Hardware, nodes: int,
             global_batch: int, seq_len: int, optimizer: str = "adamw", fp8_params: int = 0,
             fp8_gathered: frozenset[str] = frozenset(), pipeline: tuple[str, int, int] | None = None) -> Candidate:
    """Predicted costs of one layout on this hardware, trained by `optimizer` (optimizer.name), with the
    matmuls of `fp8_params` parameters (fp8_matmul_params) in FP8 and the weights `fp8_gathered`
    (precision.fp8_gathered) gathered as float8; with a stage axis, on the pipeline schedule `pipeline`
    (schedule, microbatches, virtual stages), its bubble added to the step."""
    import dataclasses

    platform = "cpu" if hw.name == "cpu" else "gpu"
    remat = dataclasses.replace(cfg, remat=remat).remat_on(platform)  # "auto" as it runs there
    cfg = dataclasses.replace(cfg, remat=remat)
    shape = costs.LayoutShape.of(**sizes)
    compute = cfg.compute_dtype_on(platform)
    work = costs.Workload(global_batch, seq_len, param_bytes=costs.DTYPE_BYTES[cfg.param_dtype],
                          act_bytes=costs.DTYPE_BYTES[compute], remat=remat,
                          attention_probs=costs.keeps_attention_probs(cfg, platform, compute),
                          optimizer=optimizer, fp8_gathered=fp8_gathered, **costs.dropless_lowering(platform))
    stages, bubble = sizes.get(STAGE, 1), 0.0
    if pipeline is not None:  # (schedule, microbatches, virtual stages) on the stage axis
        kind, m, v = pipeline
        work = dataclasses.replace(work, pipeline_schedule=kind, pipeline_microbatches=m, virtual_stages=v)
        bubble = build(kind, stages, m, v).idle_fraction()
    problems = shape.divisibility_problems(cfg, global_batch, work.pipeline_microbatches, seq_len=seq_len)
    batch_ways = shape.degree(BATCH)  # as divisibility_problems counts them (one microbatch)
    memory = memory_bytes(cfg, shape, work)
    if memory["total"] > USABLE_HBM * hw.hbm_gib * GIB:
        problems.append(f"memory {memory['total'] / GIB:.1f} GiB > {USABLE_HBM:.0%} of {hw.hbm_gib:g} GiB")
    comm = costs.comm_bytes(cfg, shape, work)
    comm = {a: comm[a] for a in sorted(comm, key=lambda a: list(sizes).index(a) if a in sizes else len(sizes))}
    spans = node_split(sizes, nodes)
    crosses = {a: spans[a] > 1 for a in sizes if sizes[a] > 1}
    comm_s = {a: b / ((hw.inter_node_gbps if crosses.get(a) else hw.intra_node_gbps) * 1e9)
              for a, b in comm.items()}
    devices = math.prod(sizes.values())
    tokens = global_batch * seq_len
    flops = model_flops(cfg, tokens, seq_len, shape.degree(LENGTH), flash=not work.attention_probs)
    recompute = costs.pipeline_passes(work, stages, cfg.n_layers)["compute"] if stages > 1 else 4 / 3 if remat != "none" else 1.0
    # a stage idles for the schedule's bubble: the step is its work over the busy share
    compute_s = _compute_s(flops * recompute, 6 * fp8_params * tokens * recompute, hw) / devices / (1 - bubble)
    hbm_s = hbm_bytes(cfg, shape, work, memory) / (hw.hbm_gbps * 1e9)
    probs_s = probs_hbm_bytes(cfg, shape, work) / (hw.hbm_gbps * 1e9)
    local = max(compute_s, hbm_s - probs_s) + probs_s  # an unfused softmax waits on attention's matmuls
    # tensor parallel's all-reduces, the experts' all-to-alls and a stage's sends sit between the ops
    # that need them
    exposed = sum(comm_s.get(a, 0.0) for a in _EXPOSED)
    overlappable = sum(v for a, v in comm_s.items() if a not in _EXPOSED)
    step = max(local + exposed, overlappable)
    serial = local + sum(comm_s.values())
    mfu = mfu_flops_per_token(cfg, seq_len) * tokens / devices / (step * hw.bf16_tflops * 1e12)  # as train reports it
    return Candidate(sizes, remat, memory, comm, comm_s, crosses, compute_s, hbm_s, step, serial, mfu,
                     tokens / step, tuple(problems),
                     unsplit_batch_ways=batch_ways if global_batch % batch_ways else None,
                     pipeline=None if pipeline is None else {"schedule": kind, "microbatches": m,
                                                              "virtual_stages": v, "bubble": bubble})


_EXPOSED = (MODEL, EXPERT_AXIS, STAGE)


def _compute_s(flops: float, fp8_flops: float, hw: Hardware) -> float:
    """Seconds for `flops` at one device's rates: `fp8_flops` of them at the FP8 rate, the rest at bf16's."""
    if fp8_flops and not hw.fp8_tflops:
        raise ShardError(f"{hw.name} has no fp8_tflops (no FP8 tensor cores, or not in its hardware entry): plan "
                         "FP8 matmuls on h100 or h200, or give fp8_tflops in --hardware-file")
    fp8_s = fp8_flops / (hw.achieved_fp8_tflops * 1e12) if fp8_flops else 0.0
    return (flops - fp8_flops) / (hw.achieved_tflops * 1e12) + fp8_s


def plan(cfg: ModelConfig, devices: int, nodes: int, hw: Hardware, global_batch: int,
         seq_len: int, remats: tuple[str, ...] = REMAT_CHOICES, optimizer: str = "adamw",
         precision: dict[str, str] | None = None) -> list[Candidate]:
    """All layouts (each with every remat policy in `remats`, trained by `optimizer`, the matmuls
    `precision`'s rules pick in FP8), the fitting ones first, fastest first. A layout with a stage axis
    (`pipeline_layouts`) comes with its fastest pipeline schedule (`pipeline_choices`).
    Step times within 2% count as a tie, broken by room to spare (a layout predicted within the memory
    model's 9% error of the limit may not fit: it goes after the others), then by the time with nothing
    overlapped (less exposed traffic), then by memory."""
    for flag, value in (("--devices", devices), ("--nodes", nodes), ("--batch", global_batch), ("--seq", seq_len)):
        if value <= 0:
            raise ShardError(f"{flag} must be positive, got {value}")
    if devices % nodes:
        raise ShardError(f"{devices} devices cannot form {nodes} equal nodes; give --devices a multiple of --nodes")
    per_node = devices // nodes
    if per_node > hw.devices_per_node:
        raise ShardError(f"{per_node} devices per node, but a {hw.name} node holds at most {hw.devices_per_node}")
    fp8 = fp8_matmul_params(cfg, precision or {})
    gathered = fp8_gathered(precision or {}, cfg)
    out = [predict(cfg, sizes, remat, hw, nodes, global_batch, seq_len, optimizer, fp8, gathered)
           for sizes in layouts(devices, per_node, seq_len, cfg.n_experts) for remat in remats]
    for sizes in pipeline_layouts(devices, per_node, cfg.n_layers):
        replicas = sizes[DATA] * sizes[FSDP]
        if global_batch % replicas:
            continue
        choices = pipeline_choices(cfg, sizes[STAGE], global_batch // replicas, sizes[FSDP] > 1 and sizes[MODEL] > 1)
        for remat in remats if choices else ():  # each layout with its best schedule
            out.append(min((predict(cfg, sizes, remat, hw, nodes, global_batch, seq_len, optimizer, fp8, gathered, p)
                            for p in choices), key=lambda c: (not c.fits, c.step_s, c.memory["total"])))
    fastest = min((c.step_s for c in out), default=1.0)
    tight = (1 - MEMORY_MODEL_LOW) * USABLE_HBM * hw.hbm_gib * GIB
    return sorted(out, key=lambda c: (not c.fits, round(math.log(c.step_s / fastest) / math.log(1.02)),
                                      c.memory["total"] > tight, c.step_s_serial, c.memory["total"]))


def optimizer_state(cfg: ModelConfig, candidate: Candidate, optimizer: str) -> dict[str, float]:
    """Per-device optimizer state bytes of a layout under `optimizer` and under AdamW, to compare."""
    shape = costs.LayoutShape.of(**candidate.sizes)
    work = costs.Workload(1, 1, param_bytes=costs.DTYPE_BYTES[cfg.param_dtype])
    return {name: optimizer_bytes(cfg, shape, dataclasses.replace(work, optimizer=name))
            for name in dict.fromkeys((optimizer, "adamw"))}
