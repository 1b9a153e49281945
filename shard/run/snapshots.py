"""Local snapshots: a frequent, cheap save of the train state between the durable checkpoints, so that a
kill -9 or a lost host costs at most `checkpoint.local_every` steps (docs/checkpoints.md, "Local
snapshots").

A snapshot is a checkpoint like the durable ones (shard.run.checkpoint: the `state` and `meta` items in
orbax's standard format, each process writing the shards it holds, restorable onto any mesh and process
count), in a folder of its own: `checkpoint.local_dir`, by default a RAM disk folder
/dev/shm/shard-snapshots/<hash of the run dir> (RUN_DIR/snapshots where /dev/shm can't be written). One is
kept: orbax deletes the previous one only once the next one is committed, so one snapshot is whole while
the next is written. A run that finishes removes its snapshots; one that stops or fails keeps them for
--resume, which reads the newest of the snapshot and the durable checkpoints (shard.run.resume).
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax

from shard.cluster import exchange, runtime
from shard.config.train import CheckpointConfig
from shard.run.agreement import unshared_folder
from shard.run.checkpoint import Checkpoints, SaveCheckpoints
from shard.run.checkpoint_files import Restored, step_dirs
from shard.run.read_failures import BAD, MACHINE
from shard.training.state import StateSpec

AUTO = "auto"
RAM_DISK = Path("/dev/shm")
SHARED_FOLDER = "shard-snapshots"  # on the RAM disk: one folder in it per run dir, for every user's runs
RUN_DIR_FOLDER = "snapshots"  # in the run dir, where the RAM disk can't be written


def snapshot_folder(local_dir: str, run_dir: Path, ram_disk: Path = RAM_DISK) -> Path:
    """Where a run's snapshots live: `local_dir` itself, or for "auto" a folder in
    RAM_DISK/shard-snapshots named by a hash of the run dir's absolute path when that can be written,
    else RUN_DIR/snapshots."""
    if local_dir != AUTO:
        return Path(local_dir).absolute()
    shared = ram_disk / SHARED_FOLDER
    if _writable(shared) or not shared.exists() and _writable(ram_disk):
        return shared / hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return run_dir.absolute() / RUN_DIR_FOLDER


def _writable(folder: Path) -> bool:
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def open_snapshots(cfg: CheckpointConfig, run_dir: Path, notice: Callable[[str], None]) -> "Snapshots | None":
    """The run's snapshot folder (process 0's choice, on every process) where the run saves snapshots
    (`local_every`) or the folder holds some (a resume reads, a fresh start removes, a finished run
    removes them); None otherwise. Nothing is made here: the run dir may not exist yet."""
    folder = Path(exchange.broadcast_text(str(snapshot_folder(cfg.local_dir, run_dir))))
    holds = exchange.any_process(folder.is_dir())
    if not cfg.local_every and not holds:
        return None
    return Snapshots(folder, cfg, notice, holds)


class Snapshots:
    """One run's snapshot folder: saved, read and checked as durable checkpoints are, but never set aside
    as corrupt (a snapshot that can't be read here may be whole where its files are), and removed when the
    run no longer needs it."""

    def __init__(self, folder: Path, cfg: CheckpointConfig, notice: Callable[[str], None], holds: bool):
        self.folder, self.notice, self.holds = folder, notice, holds
        kept = dataclasses.replace(cfg, every=cfg.local_every, keep=1, best_metric="")
        self.store = Checkpoints(folder, kept, notice=notice, label="local snapshot", barrier_prefix="snapshot")

    def clean_incomplete(self) -> None:
        """Remove snapshot saves that never finished (killed while written), one notice line each."""
        self.store.clean_incomplete()

    def newest_everywhere(self) -> tuple[int | None, str | None]:
        """The newest snapshot's step that any process finds (None: none), and why not every process can
        read it (None: each finds it; the folder is one host's, say)."""
        seen = [json.loads(text) for text in exchange.gather_text(json.dumps(step_dirs(self.folder)))]
        newest = max((steps[-1] for steps in seen if steps), default=None)
        lacking = [rank for rank, steps in enumerate(seen) if newest is not None and newest not in steps]
        return newest, (f"it is not in {self.folder} on process {lacking[0]}" if lacking else None)

    def read(self, step: int, spec: StateSpec) -> tuple[Restored | None, str]:
        """Snapshot `step` read into `spec`'s shardings and checked (checksums, meta) on every process:
        (it, "") or (None, why it can't be read, and on which process)."""
        restored, outcomes, _ = self.store.read_agreed(step, spec)
        if not any(outcomes):
            return restored, ""
        rank, outcome = next((r, o) for r, o in enumerate(outcomes) if o.startswith((BAD, MACHINE)))
        where = f" on process {rank}" if len(outcomes) > 1 else ""
        return None, outcome.removeprefix(BAD).removeprefix(MACHINE) + where

    def unfit(self, state_bytes: int) -> str | None:
        """Why this start can't save snapshots (None: it can): the folder can't be made, has no room for
        two snapshots (one committed while the next is written), or is not one folder every process
        sees (snapshots on one host's disk: the others' shards would be missing)."""
        problem = ""
        if runtime.context().is_main:
            try:
                _make(self.folder)
                room = shutil.disk_usage(self.folder).free + _bytes_in(self.folder)
                if room < 2 * state_bytes:
                    problem = (f"{self.folder} has room for {_gib(room)}, two snapshots (one committed while "
                               f"the next is written) take {_gib(2 * state_bytes)}")
            except OSError as e:
                problem = f"{self.folder} can't be written ({e.strerror or e})"
        problem = exchange.broadcast_text(problem)
        self.holds = True  # the folder is there now, to be removed at the end
        if not problem and (where := unshared_folder(self.folder)):
            problem = f"{self.folder} is not one folder that every process sees ({where})"
        return problem or None

    def remove_from(self, step: int) -> None:
        """Remove the snapshots at `step` and after: a course of the run that a restart could not take up
        (the snapshot could not be read there), which would stand in the way of this one's."""
        for old in self.store.steps():
            if old >= step:
                self.store.delete(old)

    def remove_all(self) -> None:
        """Remove the folder, once every process's saves are committed (every process calls it)."""
        self.store.wait()
        exchange.barrier("snapshots_written", device_collective=True)
        if runtime.context().is_main:
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.folder.parent.name == SHARED_FOLDER:  # the last run's: the RAM disk as it was
                with contextlib.suppress(OSError):
                    self.folder.parent.rmdir()
        exchange.barrier("snapshots_removed", device_collective=True)
        self.store.reload()
        self.holds = False

    def close(self) -> None:
        self.store.close()


def _make(folder: Path) -> None:
    """The folder, and the RAM disk's shared folder above it, open to every user's runs (as /tmp is)."""
    shared = folder.parent
    if shared.name == SHARED_FOLDER and not shared.exists():
        shared.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another user's run made it meanwhile
            shared.chmod(0o1777)
    folder.mkdir(parents=True, exist_ok=True)


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class SaveSnapshots(SaveCheckpoints):
    """Loop observer: a local snapshot every `checkpoint.local_every` steps that the durable saver does not
    save anyway, asynchronously as durable saves are. At the end of a run that finished (reached --steps)
    the snapshots go (RAM is precious); a run that stops or fails keeps them for --resume. Placed before the
    durable saver, it ends after it: the final checkpoint is committed before the snapshots go."""

    def __init__(self, snapshots: Snapshots, durable: SaveCheckpoints, *, seed: int, config_toml: str):
        super().__init__(snapshots.store, seed=seed, config_toml=config_toml)
        self.snapshots, self.durable = snapshots, durable

    def on_start(self, run) -> None:
        super().on_start(run)
        if self.every and (problem := self.snapshots.unfit(sum(x.nbytes for x in jax.tree.leaves(run.state)))):
            self.snapshots.notice(f"no local snapshots this start (checkpoint.local_every): {problem}; "
                                  "checkpoint.local_dir names another folder")
            self.every = 0

    def saves_at(self, step: int, final: bool) -> bool:
        return bool(self.every and step % self.every == 0 and not self.durable.saves_at(step, final))

    def on_state(self, step: int, state: dict, position: int, metrics: dict, final: bool) -> None:
        if self.saves_at(step, final):
            self.snapshots.remove_from(step)
        super().on_state(step, state, position, metrics, final)

    def on_end(self, records: list[dict]) -> None:
        self.checkpoints.wait()
        if self.run is not None and self.run.stopped_at is None and self.snapshots.holds:
            self.snapshots.remove_all()
