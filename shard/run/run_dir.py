"""A run's directory: where a run writes, whether a folder already holds one, what a failed start
leaves behind, and the command that continues it. No JAX: the CLI checks these before devices start."""

import os
import re
import shlex
import shutil
import time
from pathlib import Path

from shard.config.resolve import differences, load_file, resolve
from shard.config.train import TrainConfig
from shard.errors import ShardError
from shard.sharding.mesh import MeshSpec, rename_mesh_file
from shard.paths import (CHECKPOINTS_DIR, TOKENIZER_DIR, WANDB_ID, RunDirLock, check_outside_checkpoints,
                         remove_made_folders)


def compile_cache_dir(cfg: TrainConfig, run_dir: Path) -> Path | None:
    """`auto`: one cache beside the run dirs, so a restart or the next run does not recompile."""
    if cfg.xla.compile_cache in ("", "none"):
        return None
    if cfg.xla.compile_cache == "auto":
        return run_dir.parent / ".compile_cache"
    check_outside_checkpoints(Path(cfg.xla.compile_cache), "compile cache")
    return Path(cfg.xla.compile_cache)


# What a run writes; hidden entries (a stale .lock or start-up marker, .compile_cache, .DS_Store) never count.
RUN_FILES = ("config.toml", "metrics.jsonl", "tb", CHECKPOINTS_DIR, "profile", WANDB_ID, "wandb")


def holds_run(path: Path) -> bool:
    """A config.toml (a user's own too: never overwritten), a logged step or a checkpoint."""
    return (path / "config.toml").exists() or has_records(path)


def config_on_record(path: Path) -> bool:
    """The run dir's config.toml is there and says something (a full disk once left one empty)."""
    saved = path / "config.toml"
    return saved.is_file() and bool(saved.read_bytes().strip())


def has_records(path: Path) -> bool:
    """A logged step or a saved checkpoint (an empty checkpoints/, or a metrics.jsonl with no step record,
    such as the events of a supervisor whose job has not logged yet, is neither)."""
    from shard.observe.metrics import holds_step_record

    metrics, checkpoints = path / "metrics.jsonl", path / CHECKPOINTS_DIR
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    return metrics.is_file() and metrics.stat().st_size > 0 and holds_step_record(metrics)


def start_files() -> tuple[str, ...]:
    """What a fresh start writes before its first step is logged or saved."""
    from shard.run.hf_side import SIDE_DIR

    return ("config.toml", SIDE_DIR, TOKENIZER_DIR, "metrics.jsonl", "tb", WANDB_ID, "wandb")


def forget_unstarted_run(path: Path, found: set[str]) -> None:
    """After a fresh run failed before it logged or saved anything (out of memory in step 1), remove the
    files it wrote, so the corrected command may use the same run dir. `found` names those that were
    there before it started, which stay: a --resume --allow-fresh base's config.toml and the Hugging
    Face side files beside it, a user's own tb/."""
    if has_records(path):
        return
    for name in start_files():
        target = path / name
        if name in found:
            continue
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def choose_run_dir(cfg: TrainConfig, mesh_spec: MeshSpec, resume: bool = False) -> Path:
    """Where this run writes; a run dir that holds another run is reused only with --resume."""
    if cfg.run_dir:
        path = Path(cfg.run_dir)
        check_outside_checkpoints(path, "run dir")
        if path.exists() and not path.is_dir():
            raise ShardError(f"run dir {path} is a file; choose another --run-dir")
        above = next((p for p in path.absolute().parents if p.exists()), None)  # None: path is /
        if above is not None and not above.is_dir():
            raise ShardError(f"run dir {path} can't be made: {above} is a file; choose another --run-dir")
        if path.is_dir():
            RunDirLock(path).check_free()  # a run still starting there is in use, not "crashed"
        if not resume and holds_run(path):
            if config_on_record(path):
                try:
                    theirs = resolve(load_file(str(path / "config.toml")))
                except ShardError:
                    theirs = None
                # how the processes meet, where compiled programs are cached, or where the run is tracked,
                # is not the run's identity
                ignore = ("run_dir", "cluster", "xla.compile_cache", "tracking")
                diff = differences(theirs, cfg, ignore=ignore) if theirs else []
                if diff:
                    key, there, here = diff[0]
                    # its checkpoints load into another model only where the model is the same
                    hint = "" if key.startswith("model.") else ", or pass --resume to continue that run with this change"
                    raise ShardError(f"run dir {path} belongs to a different config ({key} is {there!r} there, "
                                     f"{here!r} here); choose another --run-dir{hint}")
            if not has_records(path):  # its start died before its first step was logged or saved
                raise ShardError(f"run dir {path} holds a run that never logged a step or saved a checkpoint (a "
                                 "start that crashed?); pass --resume --allow-fresh to start it again, or choose "
                                 "another --run-dir")
            raise ShardError(f"run dir {path} already holds a run; pass --resume to continue it or choose another "
                             "--run-dir")
        if path.is_dir() and not holds_run(path):  # --resume --allow-fresh too would start one here
            foreign = sorted(p.name for p in path.iterdir() if p.name not in RUN_FILES and not p.name.startswith("."))
            if foreign:
                raise ShardError(f"run dir {path} holds files that are not a shard run (e.g. {foreign[0]}); give a "
                                 "new or empty folder")
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{cfg.model.name}-{mesh_label(mesh_spec.source)}-{stamp}"
    check_writable(path)
    return path


def check_writable(path: Path) -> None:
    """Write a file in the run dir and take it away again, with any folders made for it, so a run dir
    that can't be written (read-only, no permission, /proc) fails before the devices start and the step
    compiles, and a start that fails leaves no trace."""
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    probe = path / f".shard-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ShardError(f"run dir {path} can't be written ({e.strerror or e}); choose another --run-dir") from None
    finally:
        remove_made_folders(made)


def mesh_label(source: str) -> str:
    """A mesh as given, made one folder name: `data=2,fsdp=4` -> `data2_fsdp4`; a TOML file by its stem."""
    source = rename_mesh_file(source, lambda path: path.stem)  # a TOML file by its stem (and shape)
    return re.sub(r"[^\w.-]+", "_", source.replace("=", "")).strip("_.") or "mesh"


def continue_command(path: Path, cluster) -> str:
    """The command that resumes a stopped run: under the launcher that started it, on every process."""
    resume = f"shard train --run-dir {shlex.quote(str(path))} --resume"  # pasted into a shell
    if cluster is None:
        return resume
    if cluster.launcher == "mpi":
        return f"mpiexec -n {cluster.num_processes} {resume}"
    if cluster.launcher == "slurm":
        return f"srun {resume} (in the same allocation)"
    return (f"{resume} --coordinator {cluster.coordinator} --num-processes {cluster.num_processes} "
            f"--process-id I, on each process I")
