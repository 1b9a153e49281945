"""`shard export`: a checkpoint's params alone, for code outside shard."""

from pathlib import Path
from typing import Annotated

import typer

from shard.cli.options import CheckpointArg, CheckpointOpt, checkpoint_given
from shard.observe.console import console


def export(
    out: Annotated[Path, typer.Option("--out", help="new directory for the params-only orbax checkpoint")],
    checkpoint: CheckpointArg = None,
    checkpoint_opt: CheckpointOpt = None,
):
    """Write a checkpoint's params alone, as a plain orbax checkpoint for code outside shard.

    shard's own generate, eval and --init-from read the training checkpoint itself."""
    from shard.run.stored import export_params

    target, step = export_params(Path(checkpoint_given(checkpoint, checkpoint_opt)), out)
    console.print(f"exported the params of step {step} to {target}")
