"""Start-up checks that the processes of one job agree: the same config, the same data behind its data
paths, and (under the global mesh) one run dir that all of them see. Without them a job started with
different commands trains on mismatched batches or waits in a collective for ever, one whose hosts
hold different files at the data path trains each process's rows on other data in silence, and one
whose run dir is a different folder on each host never finishes its first checkpoint.

They run once every process has joined, before anything is compiled or written; a mismatch is a
ShardError on every process.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
import tomllib
from pathlib import Path

from shard.config.resolve import differences, resolve, to_toml
from shard.config.train import TrainConfig
from shard.cluster import exchange, runtime
from shard.errors import ShardError
from shard.sharding.mesh import rename_mesh_file

_FILES = "<files>"


def _comparable(cfg: TrainConfig) -> TrainConfig:
    """The config as the processes of one job must agree on it. Process 0 alone picks the run dir's name,
    and each process's data paths are absolute from its own working directory: check_same_data compares
    what they hold, here only whether each names files, the embedded corpus, synthetic data or nothing."""
    from shard.data.sources import EMBEDDED, SYNTHETIC

    def kind(path: str) -> str:
        return path if path in (EMBEDDED, SYNTHETIC) else _FILES

    mesh = rename_mesh_file(cfg.mesh.spec, lambda path: path.name)  # absolute, like the data paths
    return dataclasses.replace(cfg, run_dir="", data=dataclasses.replace(cfg.data, path=kind(cfg.data.path)),
                               eval=dataclasses.replace(cfg.eval, path=kind(cfg.eval.path)),
                               mesh=dataclasses.replace(cfg.mesh, spec=mesh))


def check_same_config(cfg: TrainConfig, start: dict[str, object] | None = None) -> None:
    """Every process resolved the same config as process 0 (from the flags, files and --set it got), and
    was given the same `start` flags, which the config does not hold (`--resume`, `--allow-fresh`): a
    process that resumed while another initialised waited in a collective for ever."""
    mine = to_toml(_comparable(cfg))
    flags = json.dumps(start or {})
    theirs, their_flags = json.loads(exchange.broadcast_text(json.dumps([mine, flags])))
    differs = (theirs, their_flags) != (mine, flags)
    # the message is made before the processes agree that one differs: process 0 stops at once then, and
    # a process still resolving process 0's config to name the key was told "lost process 0" instead
    problem = _difference(cfg, start, mine, flags, theirs, their_flags) if differs else None
    if not exchange.any_process(differs):
        return
    raise ShardError(problem or "another process of this job was started with a different config (or --resume, "
                     "--allow-fresh, --init-from); start every process with the same command")


def _difference(cfg, start, mine: str, flags: str, theirs: str, their_flags: str) -> str:
    """What this process was started with that process 0 was not (its config `theirs`, flags `their_flags`)."""
    rank = runtime.context().rank
    if theirs == mine:
        ours, zeros = (start or {}), json.loads(their_flags)
        flag = next(k for k in {**ours, **zeros} if ours.get(k) != zeros.get(k))
        return (f"process {rank} was started with {_flag_text(flag, ours.get(flag))}, process 0 with "
                f"{_flag_text(flag, zeros.get(flag))}; start every process with the same command")
    diff = differences(resolve(tomllib.loads(theirs)), _comparable(cfg), ignore=("run_dir",))
    what = f": {diff[0][0]} is {diff[0][1]!r} on process 0, {diff[0][2]!r} here" if diff else ""
    return (f"process {rank} was started with a different config from process 0's{what}; start every process "
            "with the same command")


def _flag_text(flag: str, value) -> str:
    if value in (None, False):
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"


def check_same_data(cfg: TrainConfig, source=None) -> None:
    """Every process finds the same data at data.path (and eval.path) as process 0: the same files, by
    name, size and a CRC of each one's ends (shard.data.sources.source_signature); `source`: data.path's
    description, where the caller has it."""
    from shard.data.sources import describe_data, source_signature

    if runtime.context().size < 2:
        return
    sources = [("data.path", cfg.data.path)]  # "" there: the embedded corpus; in eval.path: none
    if cfg.eval.every and cfg.eval.path:
        sources.append(("eval.path", cfg.eval.path))
    for key, path in sources:
        try:
            described = source if key == "data.path" and source is not None else describe_data(path)
            mine = source_signature(described)
        except (ShardError, OSError) as e:  # said after the exchange, which every process makes alike
            mine = f"error: {e}"
        digest = hashlib.sha256(mine.encode()).hexdigest()  # the lines travel only when they differ
        differs = exchange.broadcast_text(digest) != digest
        if not exchange.any_process(differs or mine.startswith("error: ")):
            continue
        theirs = exchange.broadcast_text(mine)
        if mine.startswith("error: "):
            raise ShardError(mine.removeprefix("error: "))
        if not differs:
            raise ShardError(f"{key} {path or '(the embedded corpus)'} holds other data on another process of "
                             "this job than on process 0, or can't be read there; give every process the same "
                             "files")
        there, here = _first_difference(theirs.splitlines(), mine.splitlines())
        raise ShardError(f"{key} {path or '(the embedded corpus)'} holds other data here than on process 0 "
                         f"(name, bytes, CRC: {there!r} there, {here!r} here); give every process the same files")


def _first_difference(a: list[str], b: list[str]) -> tuple[str, str]:
    """The first pair of lines that differ, "no such file" standing in past the end of a shorter list."""
    padded = max(len(a), len(b))
    a, b = a + ["no such file"] * (padded - len(a)), b + ["no such file"] * (padded - len(b))
    return next((x, y) for x, y in zip(a, b, strict=True) if x != y)


def check_shared_run_dir(path: Path) -> None:
    """Under the global mesh every process writes its checkpoint shards under the run dir, so `path`
    (process 0's string, read from each process's working directory) must be one folder that all of
    them see."""
    ctx = runtime.context()
    if ctx.mode != runtime.XLA or ctx.size < 2:
        return
    if where := unshared_folder(path):
        raise ShardError(
            f"run dir {path} is not one folder shared by every process ({where}): with --cross-host xla each "
            "process writes its checkpoint shards there; give an absolute --run-dir on a shared file system")


def unshared_folder(path: Path) -> str | None:
    """Whether `path` (process 0's string, read from each process's working directory) is one folder
    that every process sees: None when it is (or one process runs), else which process does not see it.
    Process 0 leaves a marker file in it (or its nearest existing parent) and the others look for it
    there."""
    if runtime.context().size < 2:
        return None
    levels = (path.absolute(), *path.absolute().parents)  # the folder, then the folders above it
    made: Path | None = None
    marker = ""  # "UP/NAME": file NAME in the folder UP levels above `path`
    if runtime.context().is_main:
        up = next(i for i, p in enumerate(levels) if p.is_dir())
        try:
            fd, name = tempfile.mkstemp(prefix=".shard-shared-", dir=levels[up])
            os.close(fd)
            made, marker = Path(name), f"{up}/{Path(name).name}"
        except OSError:  # not writable: writing there will say so
            pass
    marker = exchange.broadcast_text(marker)
    missing = False
    if marker:
        above, name = marker.split("/", 1)
        missing = int(above) >= len(levels) or not (levels[int(above)] / name).exists()
    try:
        lost = exchange.any_process(missing)
    finally:
        if made is not None:
            made.unlink(missing_ok=True)
    if not lost:
        return None
    return "this process does not see it" if missing else "another process does not see it"
