"""`shard plan --stages S`: the pipeline schedules (and virtual stage counts) a model can run on S stages
with M microbatches, each with its bubble (by table and by formula), the activations a stage keeps and
the buffers it sends, ranked. Pure Python over the schedule tables (shard/parallel/schedule.py).
"""

from __future__ import annotations

from shard.config.model import ModelConfig
from shard.errors import ShardError
from shard.parallel.schedule import SCHEDULES, bubble_formula, build, check, slots

MAX_VIRTUAL = 4  # interleaved beyond 4 chunks a stage: sends grow with V for little bubble left
MICROBATCHES_PER_STAGE = (1, 2, 4)  # `shard plan` tries M = k S microbatches for each of these k


def pipeline_choices(cfg: ModelConfig, stages: int, rows_per_replica: int, fsdp_and_model: bool = False
                     ) -> list[tuple[str, int, int]]:
    """(schedule, microbatches M, virtual stages V) that `shard train` runs on `stages` stages with this many
    rows per data-parallel replica: M = k S (`MICROBATCHES_PER_STAGE`) that splits the rows, every schedule
    and V the table allows (`check`); only GPipe beside both fsdp and model (`fsdp_and_model`), where
    shard.training.step refuses the others. None for a model the pipeline does not run (experts, MTP)."""
    if cfg.n_experts or cfg.mtp_depth:
        return []
    out = []
    for m in (k * stages for k in MICROBATCHES_PER_STAGE):
        if rows_per_replica % m:
            continue
        kinds = SCHEDULES if not fsdp_and_model else ("gpipe",)
        out += [(kind, m, v) for kind, v in _runnable(kinds, stages, m, cfg.n_layers)]
    return out


def _runnable(kinds, stages: int, microbatches: int, n_layers: int):
    """(kind, V) of each schedule of `kinds` whose table `check` allows at these sizes; interleaved from
    V = 2 (V = 1 is 1F1B's table)."""
    for kind in kinds:
        for v in range(2, MAX_VIRTUAL + 1) if kind == "interleaved" else (1,):
            try:
                check(kind, stages, microbatches, v, n_layers)
            except ShardError:
                continue
            yield kind, v


def rows_per_replica(global_batch: int, devices: int, stages: int) -> int:
    """The rows each data-parallel replica of a pipeline over `stages` of `devices` devices takes."""
    if stages < 1 or devices % stages:
        raise ShardError(f"--stages {stages} does not divide --devices {devices}")
    if global_batch % (devices // stages):
        raise ShardError(f"the global batch {global_batch} does not split over {devices // stages} data-parallel "
                         f"replicas of {stages} stages")
    return global_batch // (devices // stages)


def schedule_options(cfg: ModelConfig, stages: int, microbatches: int, rows_per_replica: int, seq_len: int,
                     act_bytes: int) -> list[dict]:
    """Every schedule x virtual stages that runs here, smallest bubble first (ties: less memory).

    Activation memory per device: the recomputing schedules (1F1B, interleaved, zero-bubble) keep, per
    stage, `slots` stored stage inputs and as many incoming gradients of one microbatch (rows x T x D);
    GPipe differentiates through its loop and keeps the residual stream of every layer it holds for
    all M microbatches (a lower bound: the layers' own residuals come on top). Sends: buffers of
    rows x T x D a stage boundary passes per step, both directions."""
    if stages < 2:
        raise ShardError(f"--stages must be 2 or more, got {stages}")
    if microbatches < 1:
        raise ShardError(f"--microbatches must be 1 or more, got {microbatches}")
    if rows_per_replica % microbatches:
        raise ShardError(f"the batch ({rows_per_replica} rows per replica) does not split into {microbatches} "
                         "microbatches")
    per_input = rows_per_replica // microbatches * seq_len * cfg.d_model * act_bytes
    out = []
    for kind, v in _runnable(SCHEDULES, stages, microbatches, cfg.n_layers):
        sch = build(kind, stages, microbatches, v)
        held = (microbatches * cfg.n_layers // stages if kind == "gpipe" else 2 * slots(sch)) * per_input
        out.append({"schedule": kind, "virtual_stages": v, "ticks": sch.ticks, "bubble": sch.idle_fraction(),
                    "bubble_formula": bubble_formula(kind, stages, microbatches, v),
                    "activation_bytes": held, "sends": 2 * microbatches * (v * stages - 1)})
    return sorted(out, key=lambda r: (round(r["bubble"], 9), r["activation_bytes"]))
