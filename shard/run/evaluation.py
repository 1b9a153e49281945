"""`shard eval` as library calls: a checkpoint's held-out loss and perplexity (`held_out_loss`), or its
scores on lm-evaluation-harness tasks (`task_scores`), on a mesh started for them as train starts one."""

import dataclasses
import logging
import time
from pathlib import Path

from shard.errors import ShardError
from shard.observe.console import note as console_note
from shard.observe.console import warn as console_warn
from shard.run.inference import load_model, start_jax
from shard.run.devices import Notice


def held_out_loss(checkpoint: str, data: str | None = None, mesh: str = "1x1", *, batches: int | None = None,
                  batch: int | None = None, seq: int | None = None, simulate_devices: int | None = None,
                  sets: list[str] | None = None, notice: Notice = console_warn) -> dict:
    """The loss and perplexity of the weights at `checkpoint` over `batches` global batches of `batch` x
    `seq` (default: its run's) of the data it held out (or `data`, read with the weights' tokenizer):
    shard.training.evaluate.evaluate_checkpoint's figures, "data" describing what was scored."""
    for name, value in (("--batches", batches), ("--batch", batch), ("--seq", seq)):
        if value is not None and value < 1:
            raise ShardError(f"{name} must be positive, got {value}")
    from shard.run import weights
    from shard.training.evaluate import held_out_source

    if not Path(checkpoint).exists():
        raise ShardError(f"weights path {checkpoint} does not exist")
    saved, source = held_out_source(weights.saved_run_config(checkpoint), data, checkpoint,
                                    weights.held_out_since(checkpoint))
    batch, seq = batch or saved.data.batch, seq or saved.data.seq_len
    batches = batches or saved.eval.batches
    tcfg, mesh_spec, devices = start_jax(mesh, simulate_devices, sets)
    from shard.data.tokenizers import BYTE_FILE
    from shard.run.tokenizer import tokenizer_folder
    from shard.training.evaluate import evaluate_checkpoint
    from shard.training.step import check_batch

    loaded = load_model(checkpoint, tcfg, mesh_spec, devices)
    data_cfg = dataclasses.replace(saved.data, batch=batch, seq_len=seq)
    folder = tokenizer_folder(checkpoint)  # the tokenizer that came with the weights reads the text
    if folder is not None and not (folder / BYTE_FILE).is_file():
        data_cfg = dataclasses.replace(data_cfg, tokenizer=str(folder))
    cfg = dataclasses.replace(saved, model=loaded.model, data=data_cfg)
    check_batch(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, microbatches=1)), loaded.layout)  # and --seq
    return evaluate_checkpoint(cfg, loaded.layout, loaded.host_params, weights.place, batches, source, notice=notice,
                               router_bias=loaded.host_router_bias)


@dataclasses.dataclass(frozen=True)
class TaskScores:
    """lm-eval's results of some tasks, the JSON file they were written to, and whether this process wrote it
    (process 0: the others scored their share and write nothing)."""

    results: dict
    file: Path
    main: bool

    def table(self) -> str:
        """lm-eval's own table of the results (and of the groups')."""
        from shard.training.harness import table

        return table(self.results)


def task_scores(checkpoint: str, tasks: list[str], *, num_fewshot: int | None = None, limit: int | None = None,
                batch: int | None = None, mesh: str = "1x1", simulate_devices: int | None = None,
                sets: list[str] | None = None, note: Notice = console_note, out: Path | None = None) -> TaskScores:
    """The weights at `checkpoint` scored on lm-eval `tasks` (names and task YAML files), `batch` rows at
    a time (default: its run's batch, else 8); the results JSON written into the folder `out` (default:
    see results_file)."""
    if batch is not None and batch < 1:
        raise ShardError(f"--batch must be positive, got {batch}")
    from shard.training.harness import check_counts, run_tasks, task_specs, write_results

    check_counts(num_fewshot, limit)
    if not Path(checkpoint).exists():
        raise ShardError(f"weights path {checkpoint} does not exist")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on each task; the table says what ran
    resolved = task_specs(tasks)  # an unknown task fails before the weights load
    from shard.cluster import runtime
    from shard.run import weights
    from shard.run.harness import harness_lm

    saved = weights.saved_run_config(checkpoint)
    tcfg, mesh_spec, devices = start_jax(mesh, simulate_devices, sets)
    lm = harness_lm(checkpoint, tcfg, mesh_spec, devices, batch or (saved.data.batch if saved else 8), notice=note)
    results = run_tasks(lm, resolved, num_fewshot, limit)
    file = results_file(checkpoint, time.strftime("%Y%m%d-%H%M%S"), out)
    main = runtime.context().is_main
    if main:
        write_results(results, file)
    return TaskScores(results, file, main)


def results_file(checkpoint: str, stamp: str, out: Path | None = None) -> Path:
    """Where a checkpoint's task scores go: `out`, else its run dir's eval/ folder; a Hugging Face folder's
    into the working directory's eval/ (never into the folder: an export is not written to)."""
    from shard.run.checkpoint import find_checkpoint
    from shard.run.hf_config import is_hf_dir

    if is_hf_dir(checkpoint):
        return (out or Path("eval")) / f"harness-{Path(checkpoint).absolute().name}-{stamp}.json"
    directory, step = find_checkpoint(checkpoint)
    return (out or directory.parent / "eval") / f"harness-step{step}-{stamp}.json"
