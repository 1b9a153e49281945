"""Paths shard writes, and the ones it refuses to write to; no JAX, so the CLI checks them before
any device starts."""

from pathlib import Path

from shard.errors import ShardError

CHECKPOINTS_DIR = "checkpoints"  # a run dir's checkpoints, one folder per step


def globless(path: Path) -> Path:
    """orbax finds the per-process parts of a save by globbing under its path, so a path holding
    [ or ] saves a checkpoint that can't be read back (exit 0, then a lost run on resume)."""
    if "[" in str(path) or "]" in str(path):
        raise ShardError(f"checkpoint path {path} contains [ or ], which orbax reads as a glob pattern: its "
                         "checkpoints would not read back; choose a path without brackets")
    return path


def check_fresh_out(out: Path) -> None:
    """Never write into (or over) a folder that already holds something."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardError(f"--out {out} exists and is not an empty folder; choose another")
