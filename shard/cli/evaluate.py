"""`shard eval`: a checkpoint's held-out loss and perplexity (shard.training.evaluate.evaluate_checkpoint),
or with --tasks its scores on lm-evaluation-harness tasks (shard.training.harness)."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shard.cli.options import CheckpointOpt, SimOpt, WeightsArg, check_rules_only, checkpoint_given, note, warn
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
    out: Annotated[Path | None, typer.Option("--out", help="--tasks: folder for the results JSON (default: the "
                                             "run dir's eval/; a Hugging Face folder's: ./eval/)")] = None,
):
    """Held-out loss and perplexity of a checkpoint: the run's held-out data (as its evaluations saw
    it) or --data; or with --tasks, its scores on lm-evaluation-harness tasks."""
    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    check_rules_only(set_, "eval")
    if tasks is not None:
        given = [name for name, v in (("--data", data), ("--batches", batches), ("--seq", seq)) if v is not None]
        if given:
            raise ShardError(f"{given[0]} is for the held-out loss; --tasks scores lm-eval tasks")
        return _tasks(checkpoint, tasks, num_fewshot, limit, batch, mesh, json_out, simulate_devices, set_, out)
    if num_fewshot is not None or limit is not None or out is not None:
        raise ShardError("--num-fewshot, --limit and --out go with --tasks")
    from shard.run.evaluation import held_out_loss

    figures = held_out_loss(checkpoint, data, mesh, batches=batches, batch=batch, seq=seq,
                            simulate_devices=simulate_devices, sets=set_, notice=warn)
    if json_out:
        print(json.dumps(figures))
    else:
        console.print(f"eval loss {figures['eval_loss']:.4f} (perplexity {figures['perplexity']:,.2f}) over "
                      f"{figures['batches']} batch(es) of {figures['batch']} x {figures['seq_len']} "
                      f"({figures['tokens']:,} tokens) of {escape(figures['data'])}", soft_wrap=True)


def _tasks(checkpoint: str, tasks: str, num_fewshot: int | None, limit: int | None, batch: int | None, mesh: str,
           json_out: bool, simulate_devices: int | None, set_: list[str] | None, out: Path | None) -> None:
    """`shard eval --tasks`: lm-eval's table, and its results JSON in --out or an eval/ folder."""
    from shard.run.evaluation import task_scores

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    scores = task_scores(checkpoint, names, num_fewshot=num_fewshot, limit=limit, batch=batch, mesh=mesh,
                         simulate_devices=simulate_devices, sets=set_, note=note, out=out)
    if not scores.main:
        return
    if json_out:
        print(json.dumps({"results": scores.results["results"], "file": str(scores.file)}, default=str))
    else:
        console.print(scores.table(), soft_wrap=True, markup=False, highlight=False)
        note(f"wrote {scores.file}")
