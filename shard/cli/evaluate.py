"""`shard eval`: a checkpoint's held-out loss and perplexity (shard.training.evaluate.evaluate_checkpoint),
or with --tasks its scores on lm-evaluation-harness tasks (shard.training.harness)."""

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shard.cli.options import (CheckpointOpt, SimOpt, WeightsArg, check_rules_only, checkpoint_given, host_jax, note,
                                warn)
from shard.errors import ShardError
from shard.observe.console import console


def evaluate(
    checkpoint: WeightsArg = None,
    checkpoint_opt: CheckpointOpt = None,
    data: Annotated[str | None, typer.Option(
        help="data to score, as train's --data takes it, read with the weights' tokenizer (default: the run's held-out data)")] = None,
    batches: Annotated[int | None, typer.Option(help="global batches (default: the run's eval.batches)")] = None,
    batch: Annotated[int | None, typer.Option(help="global batch (default: the run's data.batch)")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length (default: the run's data.seq_len)")] = None,
    mesh: Annotated[str, typer.Option(help="mesh to evaluate on")] = "1x1",
    json_out: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
    simulate_devices: SimOpt = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a sharding rule: --set rules.vocab=none")] = None,
    tasks: Annotated[str | None, typer.Option(
        help="lm-eval tasks instead of the held-out loss: names and task YAML files, comma-separated")] = None,
    num_fewshot: Annotated[int | None, typer.Option("--num-fewshot", help="--tasks: examples shown first")] = None,
    limit: Annotated[int | None, typer.Option(help="--tasks: examples per task (default: all)")] = None,
):
    """Held-out loss and perplexity of a checkpoint: the run's held-out data (as its evaluations saw
    it) or --data; or with --tasks, its scores on lm-evaluation-harness tasks."""
    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    check_rules_only(set_, "eval")
    if tasks is not None:
        given = [name for name, v in (("--data", data), ("--batches", batches), ("--seq", seq)) if v is not None]
        if given:
            raise ShardError(f"{given[0]} is for the held-out loss; --tasks scores lm-eval tasks")
        return _tasks(checkpoint, tasks, num_fewshot, limit, batch, mesh, json_out, simulate_devices, set_)
    if num_fewshot is not None or limit is not None:
        raise ShardError("--num-fewshot and --limit go with --tasks")
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
    tcfg, mesh_spec, devices = host_jax(mesh, simulate_devices, set_)
    from shard.training.evaluate import evaluate_checkpoint
    from shard.training.step import check_batch
    from shard.sharding.layout import make_layout

    model_cfg, params, router_bias = weights.load_with_router_bias(checkpoint)
    data_cfg = dataclasses.replace(saved.data, batch=batch, seq_len=seq)
    from shard.data.tokenizers import BYTE_FILE
    from shard.run.tokenizer import tokenizer_folder

    folder = tokenizer_folder(checkpoint)  # the tokenizer that came with the weights reads the text
    if folder is not None and not (folder / BYTE_FILE).is_file():
        data_cfg = dataclasses.replace(data_cfg, tokenizer=str(folder))
    cfg = dataclasses.replace(saved, model=model_cfg, data=data_cfg)
    layout = make_layout(dataclasses.replace(tcfg, model=model_cfg), mesh_spec, devices)
    check_batch(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, microbatches=1)), layout)  # and --seq
    figures = evaluate_checkpoint(cfg, layout, params, weights.place, batches, source, notice=warn,
                                  router_bias=router_bias)
    if json_out:
        print(json.dumps(figures))
    else:
        console.print(f"eval loss {figures['eval_loss']:.4f} (perplexity {figures['perplexity']:,.2f}) over "
                      f"{figures['batches']} batch(es) of {batch} x {seq} ({figures['tokens']:,} tokens) of "
                      f"{escape(source)}", soft_wrap=True)


def _tasks(checkpoint: str, tasks: str, num_fewshot: int | None, limit: int | None, batch: int | None, mesh: str,
           json_out: bool, simulate_devices: int | None, set_: list[str] | None) -> None:
    """`shard eval --tasks`: lm-eval's table, and its results JSON in the run dir's eval/ folder."""
    import logging
    import time

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if batch is not None and batch < 1:
        raise ShardError(f"--batch must be positive, got {batch}")
    from shard.training.harness import check_counts, run_tasks, table, task_specs, write_results

    check_counts(num_fewshot, limit)
    if not Path(checkpoint).exists():
        raise ShardError(f"weights path {checkpoint} does not exist")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on each task; the table says what ran
    resolved = task_specs(names)  # an unknown task fails before the weights load
    from shard.cluster import runtime
    from shard.run import weights
    from shard.run.checkpoint import find_checkpoint
    from shard.run.harness import harness_lm
    from shard.run.hf import is_hf_dir

    saved = weights.saved_run_config(checkpoint)
    tcfg, mesh_spec, devices = host_jax(mesh, simulate_devices, set_)
    lm = harness_lm(checkpoint, tcfg, mesh_spec, devices, batch or (saved.data.batch if saved else 8), notice=note)
    results = run_tasks(lm, resolved, num_fewshot, limit)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if is_hf_dir(checkpoint):
        out = Path(checkpoint) / "eval" / f"harness-{stamp}.json"
    else:
        directory, step = find_checkpoint(checkpoint)
        out = directory.parent / "eval" / f"harness-step{step}-{stamp}.json"
    if not runtime.context().is_main:
        return
    write_results(results, out)
    if json_out:
        print(json.dumps({"results": results["results"], "file": str(out)}, default=str))
    else:
        console.print(table(results), soft_wrap=True, markup=False, highlight=False)
        note(f"wrote {out}")
