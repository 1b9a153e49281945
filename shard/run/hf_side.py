"""What a run keeps of a Hugging Face folder beside its weights, the side files (tokenizer, token ids,
context length), which export-hf writes back (shard/run/hf.py), and the note of the folder an import came
from."""

import shutil
from pathlib import Path

from shard.errors import ShardError
from shard.run.hf_config import is_hf_dir, read_json

# A Hugging Face folder's files that shard's model doesn't hold (token ids, context length, generation
# defaults, the tokenizer): import-hf and train --init-from keep them in the run dir's SIDE_DIR, and
# export-hf writes them back, so a model fine-tuned here stops at its end-of-sequence token there.
SIDE_DIR = "hf"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt",
              "added_tokens.json")


def side_files_of(source: str | Path) -> Path | None:
    """The folder holding the side files of some weights: a Hugging Face folder itself, or the SIDE_DIR
    of a shard checkpoint's run dir; None when there is none."""
    from shard.run.checkpoint_files import find_checkpoint
    if is_hf_dir(source):
        return Path(source)
    side = find_checkpoint(source)[0].parent / SIDE_DIR
    return side if side.is_dir() else None


def positions_made_for(source: str | Path) -> int | None:
    """The positions the weights at `source` were made for: the max_position_embeddings of their
    config.json (a Hugging Face folder's, or the one a shard checkpoint imported from one keeps); None
    when nothing says."""
    try:
        side = side_files_of(source)
        limit = read_json(side / "config.json").get("max_position_embeddings") if side else None
    except (ShardError, OSError):
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def context_note(source: str | Path, seq_len: int) -> str | None:
    """A notice when `seq_len` is beyond the positions the weights at `source` were made for; None
    otherwise, or when nothing says."""
    limit = positions_made_for(source)
    if limit is None or seq_len <= limit:
        return None
    return (f"data.seq_len {seq_len} is beyond the {limit} positions {source} was made for "
            "(max_position_embeddings in its config.json): the positions past it are new to the model; a longer "
            "context usually comes with a larger model.rope_theta or model.rope_scaling")


# An imported run dir's note of the Hugging Face folder its weights are (SIDE_DIR/IMPORTED_FROM, an absolute
# path): a PEFT adapter trained over the import names that folder as its base, which peft can load.
IMPORTED_FROM = "imported_from"


def note_import(hf_dir: Path, run_dir: Path) -> None:
    """Record in run_dir that its weights are those of the Hugging Face folder hf_dir."""
    (run_dir / SIDE_DIR).mkdir(exist_ok=True)
    (run_dir / SIDE_DIR / IMPORTED_FROM).write_text(str(Path(hf_dir).absolute()))


def hf_origin(source: str | Path) -> Path | None:
    """The Hugging Face folder whose weights are those at `source`: the folder itself, or the one a
    shard import (step 0, never trained since) was read from, while it still exists; None otherwise."""
    from shard.run.checkpoint_files import find_checkpoint

    if is_hf_dir(source):
        return Path(source).absolute()
    try:
        directory, step = find_checkpoint(source)
        noted = directory.parent / SIDE_DIR / IMPORTED_FROM
        origin = Path(noted.read_text().strip()) if step == 0 and noted.is_file() else None
    except (ShardError, OSError, UnicodeDecodeError):
        return None
    return origin if origin is not None and is_hf_dir(origin) else None


def keep_side_files(source: str | Path, run_dir: Path) -> None:
    """Copy the side files of the weights at `source` into run_dir/SIDE_DIR (nothing when it has none)."""
    side = side_files_of(source)
    if side is not None and any((side / name).is_file() for name in SIDE_FILES):
        (run_dir / SIDE_DIR).mkdir(exist_ok=True)
        copy_side_files(side, run_dir / SIDE_DIR, SIDE_FILES)


def copy_side_files(side: Path, dest: Path, names: tuple[str, ...]) -> None:
    """Those of `names` that `side` holds, copied into `dest`."""
    for name in names:
        if (side / name).is_file():
            shutil.copyfile(side / name, dest / name)
