"""Run configuration: frozen dataclasses, one per concern, and the ranges and rules between keys that
`TrainConfig.validate` checks once the config is whole (shard.config.resolve fills it in).
"""

import re
import math
from dataclasses import dataclass, field

from shard.config.finetune import DpoConfig, GrpoConfig, LoraConfig
from shard.config.model import ModelConfig
from shard.config.precision import delayed_problems
from shard.config.presets import PRESETS
from shard.config.values import is_positive_number
from shard.errors import ShardError


@dataclass(frozen=True)
class MeshConfig:
    spec: str = "dp"  # 8x4 | data=2,fsdp=2,model=2 | preset name (shard/meshes/) | preset:4x2 | file.toml
    simulate_devices: int = 0  # CPU only: devices to simulate; 0 = as many as the mesh needs (8 to fill)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, or Muon on the layers' weight matrices (docs/config.md), with linear warmup, cosine decay to
    min_lr_ratio * lr, and global-norm clipping."""

    # "adamw" | "muon": Newton-Schulz orthogonalised momentum on the layers' weight matrices (experts one
    # by one), AdamW on the embedding, the head, norms and biases (shard.training.optimizers)
    name: str = "adamw"
    lr: float = 2e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    muon_beta: float = 0.95  # Muon's momentum (Nesterov)
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # Muon's update scaled to this RMS (Moonlight's 0.2, AdamW's typical RMS), so one lr and weight decay
    # serve both halves; 0: Keller Jordan's sqrt(max(1, fan_out / fan_in)) instead
    muon_rms: float = 0.2
    # MuonClip's QK-clip (Kimi K2): after each step, the query weights of a head whose largest attention
    # logit in the step passed this are scaled down by tau / that logit; 0: off
    qk_clip: float = 0.0


OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class DataConfig:
    # "" = the embedded corpus; "synthetic"; a prepared store (shard data prepare); a mixture (.toml); a
    # text, JSON Lines or Parquet file, a saved Hugging Face dataset, a folder or glob of them; .npy/.bin tokens
    path: str = ""
    batch: int = 16  # global batch, in sequences
    seq_len: int = 128
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    # "" = a prepared store's own (or a resumed run's), else "byte"; "byte" | tokenizer.json or a folder
    # with one (Hugging Face) | a SentencePiece .model
    tokenizer: str = ""
    text_field: str = "text"  # the text of JSON Lines rows, Parquet and dataset columns
    # concat: windows across document boundaries | packed: whole documents per row, attention and
    # positions restarting per document
    packing: str = "concat"
    # where raw sources given to `shard train` are prepared into a token store and kept for the next run;
    # "auto": <run dir parent>/.data_cache
    cache: str = "auto"


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism, active when the mesh has a `stage` axis: the batch is cut into
    `microbatches` that flow through the stages on `schedule` (gpipe | 1f1b | interleaved | zero_bubble); with
    interleaved, each stage holds `virtual_stages` chunks of layers, chunk c of stage s the model's
    (c * S + s)-th slice."""

    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
PACKING_MODES = ("concat", "packed")
CROSS_HOST_MODES = ("xla", "mpi")  # one global mesh over every process; or a mesh per process, reduced over MPI


@dataclass(frozen=True)
class GuardConfig:
    """What a diverging run does: `stop` names the first bad step and exits non-zero; `skip` drops the
    update of a step whose loss or gradient norm is not finite or above max_grad_norm."""

    action: str = "stop"  # stop | skip
    spike_factor: float = 0.0  # stop: grad_norm above this x the median of earlier steps is a spike (0: off)
    max_grad_norm: float = float("inf")  # skip: updates with a larger gradient norm are dropped


@dataclass(frozen=True)
class ObserveConfig:
    # Peak TFLOP/s per device for MFU and HFU; 0: from the hardware table by device kind (GPUs); on a
    # CPU the matmul peak benchmarks/peak.py measured on this machine, shared by the simulated devices
    # (none measured: both shares omitted).
    peak_tflops: float = 0.0


@dataclass(frozen=True)
class XlaConfig:
    """Compiler settings, applied before JAX starts."""

    gpu_flags: bool = True  # shard's GPU flag preset (shard/startup/xla_flags.py); flags already in XLA_FLAGS win
    deterministic: bool = False  # bitwise-reproducible GPU runs (slower)
    compile_cache: str = "auto"  # persistent compilation cache dir; "auto": <run dir parent>/.compile_cache; "none": off


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and what to keep (docs/checkpoints.md). The CLI always saves the last step and on
    preemption; `every` adds periodic saves."""

    # save every N steps (a kill -9 or a lost host costs at most N steps); 0 = only the last step and on
    # SIGTERM/SIGINT
    every: int = 1000
    keep: int = 3  # keep the newest K complete checkpoints
    # also keep the `keep_best` best checkpoints by this metric: "loss" or "grad_norm" (the step's), or
    # "eval_loss" (the held-out loss: saves must fall on evaluations), or a benchmark score
    # "eval/<task>/<metric>" (eval.harness_tasks: saves must fall on their evaluations; best_mode max)
    best_metric: str = ""
    best_mode: str = "min"  # min | max
    keep_best: int = 1
    # a local snapshot every N steps between the saves above (0 = off), so a kill -9 or a lost host costs
    # at most N steps; the newest one is kept, in `local_dir`: "auto" is a RAM disk folder,
    # /dev/shm/shard-snapshots/<hash of the run dir> (RUN_DIR/snapshots where /dev/shm can't be written)
    local_every: int = 0
    local_dir: str = "auto"


@dataclass(frozen=True)
class ClusterConfig:
    """Several processes: how they cross hosts, and how long a lost one may stay silent."""

    cross_host: str = "xla"  # xla: one global mesh (jax.distributed) | mpi: local meshes + the MPI bridge
    failure_timeout: float = 60.0  # seconds before a silent process counts as lost and the others stop
    join_timeout: float = 300.0  # seconds the processes wait for each other (and the coordinator) at start
    bucket_mb: float = 64.0  # MPI bridge: gradients cross hosts in buckets of at most this size
    # where the coordination service and gloo listen: auto (loopback when every process is on this host,
    # else every interface) | loopback | all | a network interface's name (see docs/cluster.md)
    bind: str = "auto"


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss every `every` steps (0: never) over `batches` global batches, computed by a process
    set of the first `processes` processes (0: all; fewer needs --cross-host mpi).

    The held-out windows come from `path` when given (a file or folder, like data.path); otherwise they
    are the last `holdout` share of data.path's windows, which training then never reads (synthetic
    data: fresh random tokens, seed + 1).

    `harness_tasks`: lm-evaluation-harness tasks (names, task YAML files; the `eval` extra) scored
    every `harness_every` steps (0: at the last step only) and at the last step, on `harness_limit`
    examples per task (0: all); logged as eval/<task>/<metric>."""

    every: int = 0
    batches: int = 2
    processes: int = 0
    path: str = ""
    holdout: float = 0.05
    harness_tasks: tuple[str, ...] = ()
    harness_every: int = 0
    harness_limit: int = 0


@dataclass(frozen=True)
class TrackingConfig:
    """Weights & Biases (the `wandb` extra): on when `project` is set. The keys left empty are wandb's
    own defaults (its WANDB_* environment variables, then its settings)."""

    project: str = ""  # "": no tracking
    entity: str = ""
    name: str = ""  # the run's display name; "": wandb picks one
    tags: tuple[str, ...] = ()
    mode: str = ""  # "" (WANDB_MODE, else online) | online | offline | disabled


TRACKING_MODES = ("", "online", "offline", "disabled")

# pretrain: next-token loss on every token | sft: on the assistant turns of conversations |
# dpo: preference pairs against the starting weights (docs/finetuning.md) | grpo: rewarded completions
# sampled each step (docs/formulas.md#grpo-the-policy-loss)
TASKS = ("pretrain", "sft", "dpo", "grpo")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: PRESETS["small"])
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Overrides of the mesh preset's rules: logical axis -> mesh axes ([] replicates).
    rules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    param_rules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Parameter path regex -> logical axes, for parameters the model does not annotate.
    param_regex: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Matmul precision: parameter path regex -> recipe, and "default" (shard.config.precision).
    precision: dict[str, str] = field(default_factory=dict)
    steps: int = 100
    seed: int = 0
    log_every: int = 10
    run_dir: str = ""
    # Weights a fresh start begins from (a shard checkpoint or a Hugging Face folder); a resume that finds
    # a checkpoint of its own reads that instead.
    init_from: str = ""
    task: str = "pretrain"  # one of TASKS

    def validate(self) -> None:
        problems = list(self.model.validate()) + _out_of_range(self) + self.lora.problems(self.model)
        if self.data.microbatches > 0 and self.data.batch % self.data.microbatches:
            problems.append(
                f"data.batch ({self.data.batch}) must be a multiple of data.microbatches ({self.data.microbatches})"
            )
        if self.pipeline.schedule not in PIPELINE_SCHEDULES:
            problems.append(f"pipeline.schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                            f"got {self.pipeline.schedule!r}")
        if self.data.packing not in PACKING_MODES:
            problems.append(f"data.packing must be one of {', '.join(PACKING_MODES)}, got {self.data.packing!r}")
        if self.guard.action not in ("stop", "skip"):
            problems.append(f"guard.action must be stop or skip, got {self.guard.action!r}")
        if self.checkpoint.best_mode not in ("min", "max"):
            problems.append(f"checkpoint.best_mode must be min or max, got {self.checkpoint.best_mode!r}")
        if not self.checkpoint.local_dir.strip():
            problems.append('checkpoint.local_dir must be "auto" or a folder, got ""')
        best = self.checkpoint.best_metric
        if best and best not in METRIC_NAMES and not is_harness_metric(best):
            problems.append(f"checkpoint.best_metric must be one of {', '.join(METRIC_NAMES)} or eval/<task>/<metric> "
                            f"(eval.harness_tasks), got {best!r}")
        if best == "eval_loss":
            problems.extend(_eval_ranking_problems(self.checkpoint, self.eval))
        if is_harness_metric(best):
            problems.extend(_harness_ranking_problems(self.checkpoint, self.eval))
        if self.cluster.cross_host not in CROSS_HOST_MODES:
            problems.append(f"cluster.cross_host must be one of {', '.join(CROSS_HOST_MODES)}, "
                            f"got {self.cluster.cross_host!r}")
        if self.cluster.bind not in ("auto", "loopback", "all") and not re.fullmatch(r"[\w.:-]{1,15}", self.cluster.bind):
            problems.append("cluster.bind must be auto, loopback, all or a network interface's name (eth1, ib0), "
                            f"got {self.cluster.bind!r}")
        if self.tracking.mode not in TRACKING_MODES:
            problems.append(f"tracking.mode must be online, offline, disabled or \"\" (wandb's default), "
                            f"got {self.tracking.mode!r}")
        problems.extend(self.grpo.problems())
        problems.extend(_task_problems(self))
        problems.extend(_precision_problems(self))
        problems.extend(_optimizer_problems(self))
        if problems:
            raise ShardError(problems[0])


def _task_problems(cfg: "TrainConfig") -> list[str]:
    """What fine-tuning (task sft or dpo) does not combine with."""
    if cfg.task not in TASKS:
        return [f"task must be one of {', '.join(TASKS)}, got {cfg.task!r}"]
    if cfg.task == "pretrain":
        return []
    if cfg.eval.every:
        return [f"task {cfg.task} has no held-out evaluation yet: leave out eval.every (--eval-every)"]
    if cfg.task == "dpo" and cfg.data.batch % 2:
        return [f"task dpo reads preference pairs, two sequences each: data.batch ({cfg.data.batch}) must be even"]
    if cfg.task == "dpo" and cfg.data.microbatches != 1:
        return ["task dpo does not accumulate microbatches yet: leave data.microbatches at 1"]
    if cfg.task == "grpo":
        return _grpo_problems(cfg)
    return []


def _grpo_problems(cfg: "TrainConfig") -> list[str]:
    g = cfg.grpo
    if cfg.data.batch % g.samples_per_prompt:
        return [f"task grpo samples grpo.samples_per_prompt ({g.samples_per_prompt}) completions a prompt: "
                f"data.batch ({cfg.data.batch}, completions a step) must be a multiple of it"]
    if g.max_new_tokens >= cfg.data.seq_len:
        return [f"grpo.max_new_tokens ({g.max_new_tokens}) leaves no room for a prompt in --seq {cfg.data.seq_len}"]
    if cfg.data.microbatches != 1:
        return ["task grpo does not accumulate microbatches yet: leave data.microbatches at 1"]
    if not g.rewards:
        return ["task grpo needs a reward: --reward answer | boxed | last_number | format | module:function"]
    return []


def _precision_problems(cfg: "TrainConfig") -> list[str]:
    """A precision rule that decides no matmul weight, or fp8_delayed where it does not run."""
    try:
        return delayed_problems(cfg)
    except ShardError as e:
        return [str(e)]


def _optimizer_problems(cfg: "TrainConfig") -> list[str]:
    """What the optimizer's name and Muon's QK-clip do not combine with."""
    opt = cfg.optimizer
    if opt.name not in OPTIMIZERS:
        return [f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {opt.name!r}"]
    if opt.name == "muon" and cfg.lora.rank:
        return ["optimizer.name=muon does not train LoRA adapters (rank-r factors, not the weight matrices Muon "
                "orthogonalises): use optimizer.name=adamw with lora.rank"]
    if opt.qk_clip and cfg.model.qk_norm:
        return [f"optimizer.qk_clip with model.qk_norm ({cfg.model.name}): the q/k norms undo a rescaled query "
                "weight and bound the logits themselves; leave optimizer.qk_clip at 0"]
    if opt.qk_clip and (cfg.lora.rank or cfg.task in ("dpo", "grpo") or cfg.cluster.cross_host == "mpi"):
        what = "lora.rank (the query weights are frozen)" if cfg.lora.rank else (
            f"task {cfg.task} (its loss records no logits)" if cfg.task in ("dpo", "grpo") else "cluster.cross_host=mpi")
        return [f"optimizer.qk_clip does not run with {what}; leave it at 0"]
    if opt.qk_clip and (cfg.model.mla or cfg.model.dense_layers or cfg.model.mtp_depth):
        return [f"optimizer.qk_clip is not yet for {cfg.model.name}'s multi-head latent attention, dense first "
                "layers or multi-token prediction (it clips the main stack's q/k heads); leave it at 0"]
    if opt.qk_clip and cfg.model.attn_softcap:
        return [f"optimizer.qk_clip with model.attn_softcap ({cfg.model.name}): the scores are soft-capped "
                "already; leave optimizer.qk_clip at 0"]
    return []


def _eval_ranking_problems(checkpoint: CheckpointConfig, evaluation: EvalConfig) -> list[str]:
    """Ranking checkpoints by the held-out loss needs one at every save (the last step evaluates too)."""
    if not evaluation.every:
        return ["checkpoint.best_metric eval_loss needs evaluations: set eval.every (--eval-every)"]
    if checkpoint.every % evaluation.every:
        return [f"checkpoint.best_metric eval_loss needs a held-out loss at every save, but checkpoint.every "
                f"({checkpoint.every}) is not a multiple of eval.every ({evaluation.every}); use a multiple of "
                f"{evaluation.every}"]
    return []


def is_harness_metric(name: str) -> bool:
    """eval/<task>/<metric>: a benchmark score (eval.harness_tasks) rather than a step's or the held-out loss."""
    parts = name.split("/")
    return len(parts) == 3 and parts[0] == "eval" and all(parts[1:])


def _harness_ranking_problems(checkpoint: CheckpointConfig, evaluation: EvalConfig) -> list[str]:
    """Ranking checkpoints by a benchmark score needs the tasks scored at every save."""
    if not evaluation.harness_tasks:
        return [f"checkpoint.best_metric {checkpoint.best_metric} needs eval.harness_tasks"]
    if not evaluation.harness_every or checkpoint.every % evaluation.harness_every:
        return [f"checkpoint.best_metric {checkpoint.best_metric} needs the tasks scored at every save, but "
                f"checkpoint.every ({checkpoint.every}) is not a multiple of eval.harness_every "
                f"({evaluation.harness_every})"]
    return []


# Every numeric key with a range: dotted key -> (test, what it must be).
_POSITIVE, _NON_NEGATIVE = (is_positive_number, "a finite positive number"), (lambda v: 0 <= v < math.inf, ">= 0")
_COUNT = (lambda v: v > 0, "positive")  # integers: no inf to exclude
# an array dimension (XLA indexes with int32), or the steps (the step counter and the schedule are int32)
_SIZE = (lambda v: 0 < v < 2**31, "positive and below 2**31")
_SECONDS = (lambda v: 0 < v <= 1e6, "positive and at most 1e6 (seconds: 11.6 days)")  # the runtime's clocks overflow
_RANGES = {
    "steps": _SIZE, "log_every": _COUNT, "seed": (lambda v: 0 <= v < 2**32, "between 0 and 2**32-1"),
    "data.batch": _SIZE, "data.seq_len": _SIZE, "data.microbatches": _COUNT, "pipeline.microbatches": _COUNT,
    "pipeline.virtual_stages": _COUNT,
    "checkpoint.every": (lambda v: v >= 0, "0 (off) or positive"), "checkpoint.keep": _COUNT,
    "checkpoint.local_every": (lambda v: v >= 0, "0 (off) or positive"),
    "eval.every": _NON_NEGATIVE, "eval.batches": _COUNT, "eval.processes": _NON_NEGATIVE,
    "eval.holdout": (lambda v: 0 < v < 1, "between 0 and 1 (exclusive): the share of data.path held out"),
    "eval.harness_every": _NON_NEGATIVE, "eval.harness_limit": _NON_NEGATIVE,
    "mesh.simulate_devices": (lambda v: v >= 0, "positive (0: what the mesh needs)"),
    "optimizer.warmup_steps": _NON_NEGATIVE, "optimizer.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "optimizer.weight_decay": _NON_NEGATIVE, "optimizer.b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.b2": (lambda v: 0 <= v < 1, "in [0, 1)"), "optimizer.eps": _POSITIVE,
    "optimizer.grad_clip": (lambda v: v > 0, "positive (inf: no clipping)"), "optimizer.lr": _POSITIVE,
    "guard.spike_factor": _NON_NEGATIVE, "guard.max_grad_norm": (lambda v: v > 0, "positive (inf: off)"),
    "observe.peak_tflops": _NON_NEGATIVE, "checkpoint.keep_best": _COUNT,
    "cluster.failure_timeout": _SECONDS, "cluster.join_timeout": _SECONDS, "cluster.bucket_mb": _POSITIVE,
    "dpo.beta": _POSITIVE, "dpo.max_prompt_tokens": (lambda v: 0 <= v < 2**31, "0 (half of --seq) or positive"),
    "grpo.samples_per_prompt": (lambda v: 2 <= v < 2**31, "at least 2 (a group to compare within)"),
    "grpo.max_new_tokens": _SIZE, "grpo.temperature": _POSITIVE, "grpo.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "grpo.updates_per_batch": _COUNT, "grpo.clip_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "grpo.clip_high": _NON_NEGATIVE, "grpo.kl_beta": _NON_NEGATIVE,
    "grpo.tis_cap": (lambda v: v == 0 or v >= 1, "0 (off) or at least 1"),
    "optimizer.muon_beta": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.muon_ns_steps": (lambda v: 0 < v <= 100, "between 1 and 100"),
    "optimizer.muon_rms": _NON_NEGATIVE, "optimizer.qk_clip": (lambda v: 0 <= v < math.inf, "0 (off) or a positive logit"),
}


def _out_of_range(cfg: "TrainConfig") -> list[str]:
    problems = []
    for key, (ok, want) in _RANGES.items():
        value = cfg
        for name in key.split("."):
            value = getattr(value, name)
        if not ok(value):
            problems.append(f"{key} must be {want}, got {value}")
    return problems


METRIC_NAMES = ("loss", "grad_norm", "eval_loss")  # metrics a checkpoint can be ranked by
