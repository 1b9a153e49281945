"""A checkpoints folder as it stands on disk, read without orbax or JAX: the layout of a step
(`<step>/state`, `<step>/meta`), the steps found, a step's meta and the config saved with it, and the
checkpoint a path names (a run dir, its checkpoints dir or one step's dir); what a restore returns
(`Restored`). shard.run.checkpoint writes and restores them; this is what reading one needs first."""

import json
from dataclasses import dataclass
from pathlib import Path

from shard.errors import ShardError
from shard.paths import CHECKPOINTS_DIR

LORA_BASE_FINGERPRINT = "lora_base_fingerprint"  # a LoRA checkpoint's meta: its base weights' checksums
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a step directory still being written
CORRUPT_PREFIX = "corrupt-"  # an unreadable checkpoint is set aside under this name, never deleted
STATE, META = "state", "meta"


@dataclass
class Restored:
    """A train state read back into the current mesh's shardings, and where its data stream stood."""

    step: int
    state: dict
    position: int  # next global sample index of the data stream
    seed: int
    config_toml: str
    path: Path
    tokens_seen: int | None = None  # tokens trained on up to `step`; None: a checkpoint from before it was saved
    # the step since which the held-out data (eval.path, or data.path's held-out tail) has been kept
    # from training; None: nothing held out, or a checkpoint from before it was saved
    held_out_since: int | None = None


def step_dirs(checkpoints: Path) -> list[int]:
    """The steps whose folders stand in `checkpoints`, oldest first: a save that orbax finished (an
    unfinished one is named <step>.orbax-checkpoint-tmp...), read from the disk without JAX."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(c.name) for c in checkpoints.iterdir() if c.name.isdigit() and c.is_dir())


def config_saved_with(checkpoints: Path) -> tuple[str, int] | None:
    """The config (TOML text) the newest checkpoint in `checkpoints` was saved with, and its step; None
    when no step holds a readable one. Each save keeps a copy in its meta item, read here as plain
    JSON: orbax's reader would start JAX, before `train` has set the device count."""
    for step in reversed(step_dirs(checkpoints)):
        text = saved_config(checkpoints / str(step))
        if text is not None:
            return text, step
    return None


def saved_config(step_dir: Path) -> str | None:
    """The config (TOML text) one checkpoint step was saved with, from its meta item read as plain JSON;
    None when it holds no readable one."""
    meta = saved_meta(step_dir)
    return meta["config"] if isinstance(meta.get("config"), str) else None


def saved_meta(step_dir: Path) -> dict:
    """A checkpoint step's meta item, read as plain JSON (orbax's reader would start JAX); {} when it
    is missing or unreadable."""
    try:
        meta = json.loads((step_dir / META / "metadata").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def find_checkpoint(path: Path | str) -> tuple[Path, int]:
    """(checkpoints dir, step) from a run dir, a checkpoints dir or one step's dir; the newest step."""
    p = Path(path).absolute()
    if not p.exists():
        raise ShardError(f"checkpoint path {path} does not exist")
    if not p.is_dir():
        raise ShardError(f"checkpoint path {path} is a file; give a run dir, its checkpoints/ dir or a step's dir")
    if (p / CHECKPOINTS_DIR).is_dir():
        p = p / CHECKPOINTS_DIR
    if (p / STATE).is_dir() and p.name.isdigit():
        return p.parent, int(p.name)
    steps = step_dirs(p)
    complete = [s for s in steps if (p / str(s) / STATE).is_dir()]
    if not complete:
        if p.name.startswith(CORRUPT_PREFIX) and p.name.removeprefix(CORRUPT_PREFIX).split(".")[0].isdigit():
            raise ShardError(f"{path} is a checkpoint step that was set aside as damaged (unreadable, or not what "
                             "its meta describes, when a run resumed); give another step's dir")
        if (p / "_CHECKPOINT_METADATA").is_file() and not steps:
            raise ShardError(f"{path} is a plain orbax checkpoint (what shard export writes), not a training "
                             "checkpoint; give a run dir, its checkpoints/ dir or a step's dir")
        raise ShardError(f"no complete checkpoint in {path}")
    if complete[-1] != steps[-1]:  # never an older model in silence
        raise ShardError(f"the newest checkpoint {p / str(steps[-1])} is damaged (no {STATE}/); pass an older "
                         f"step's dir to use it, e.g. {p / str(complete[-1])}")
    return p, complete[-1]
