"""Paths shard writes, and the ones it refuses to write to; no JAX, so the CLI checks them before
any device starts."""

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from shard.errors import ShardError

CHECKPOINTS_DIR = "checkpoints"  # a run dir's checkpoints, one folder per step
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer (shard.run.tokenizer), beside its checkpoints
WANDB_ID = "wandb_id"  # the run's Weights & Biases run id (shard.observe.tracking): a resume continues that run
LOCK_FILE = ".lock"  # in a run dir: held by the `shard train` that writes it


def globless(path: Path) -> Path:
    """orbax finds the per-process parts of a save by globbing under its path, so a path holding
    [ or ] saves a checkpoint that can't be read back (exit 0, then a lost run on resume)."""
    if "[" in str(path) or "]" in str(path):
        raise ShardError(f"checkpoint path {path} contains [ or ], which orbax reads as a glob pattern: its "
                         "checkpoints would not read back; choose a path without brackets")
    return path


@contextlib.contextmanager
def written_whole(out: Path, say=None) -> Iterator[Path]:
    """A folder written whole or not at all, so that the same command can run again after an error (a
    full disk). A new `out` is written as a hidden sibling (`.NAME.partial-*`), marked as being written
    (`writing`), renamed into place when the block ends and removed on an error, with the folders made
    above it. Such siblings that no process writes any more (a killed command's) are removed first, and
    `say` (default: stderr) names them. An existing empty `out` (a mount point, a folder made for it) is
    written in place and emptied again on an error."""
    out = out.absolute()
    if out.is_dir():  # check_fresh_out: empty
        try:
            yield out
        except BaseException:
            for entry in out.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            raise
        return
    made = [p for p in out.parents if not p.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_left_behind(sorted(out.parent.glob(f".{glob.escape(out.name)}.partial-*")), say)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        with writing(partial, f"{partial} is being written by another process"):
            yield partial
            partial.chmod(0o777 & ~current_umask())  # mkdtemp's folder is owner-only
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        remove_made_folders(made)
        raise


@contextlib.contextmanager
def writing(folder: Path, busy: str) -> Iterator[None]:
    """Mark `folder` as being written for the block: an exclusive `flock` on the folder itself, which the
    kernel drops when this process ends (and the children it forked, which share it), so a folder that a
    killed command left is told apart from one being written (`left_behind`). `busy`: the error when
    another process holds the mark. A file system without locks marks nothing."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise ShardError(busy) from None
        yield
    finally:
        os.close(fd)


def left_behind(folder: Path) -> bool:
    """Whether no process is writing `folder` (nobody holds its `writing` mark): a stopped command left it.
    False where that can't be told (no such folder, a file system without locks)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_left_behind(folders: list[Path], say=None) -> None:
    """Remove those of `folders` that a stopped command left (`left_behind`), saying which."""
    gone = [f for f in folders if not f.is_symlink() and left_behind(f)]
    for f in gone:
        shutil.rmtree(f, ignore_errors=True)
    if gone:
        (say or _to_stderr)(f"removed {len(gone)} unfinished folder(s) that a stopped command left: "
                            f"{', '.join(str(f) for f in gone)}")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def remove_made_folders(made: list[Path]) -> None:
    """Take away the folders a failed write made (deepest first), while they are empty."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's text whole or not at all (`write_atomic`, UTF-8)."""
    write_atomic(path, text.encode("utf-8"))


def write_atomic(path: Path, data, sync: bool = True) -> None:
    """Replace a file's bytes (`data`: any buffer) whole or not at all: written beside it, flushed to disk
    (`sync`), then renamed over it. A full disk or a kill mid-write leaves the old file, never an empty or
    half-written one, and the error names `path` (a write's own names no file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a write's or fsync's error names no file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def read_json_or_empty(path: Path) -> dict:
    """A JSON object that is only a courtesy (a cache, a worker's note): {} where it is missing, unreadable
    or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def current_umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def check_fresh_out(out: Path) -> None:
    """Never write into (or over) a folder that already holds something, nor among a run's checkpoints,
    where it would be taken for the newest one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardError(f"--out {out} exists and is not an empty folder; choose another")
    check_outside_checkpoints(out)


def check_outside_checkpoints(out: Path, what: str = "--out") -> None:
    """Never write among a run's checkpoints, where it would be taken for (or into) one of them, and set
    aside as a corrupt one by that run's next resume. `what` names the path in the error (`--out`, `run
    dir`, `compile cache`)."""
    for above in out.absolute().parents:
        if above.name == CHECKPOINTS_DIR and (above.parent / "config.toml").is_file() \
                and any(p.name.isdigit() and p.is_dir() for p in above.iterdir()):
            raise ShardError(f"{what} {out} is in the checkpoints folder of the run in {above.parent}, where it "
                             "would be read as one of its checkpoints; choose a path outside it")


class RunDirLock:
    """One `shard train` writes a run dir at a time: an exclusive `flock` on RUN_DIR/.lock, taken
    before the run writes or removes anything there and held until it ends (the kernel drops it when
    the process dies, so a killed run never leaves it held). The file names its holder and is removed
    on release; a lock taken on a file that was removed meanwhile is taken again on the new one. On a
    file system without locks the run goes on unlocked."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        path = self.run_dir / LOCK_FILE
        while self._fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.read(fd, 200).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return
                raise self._in_use(holder) from None
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(fd).st_ino:  # released (and removed) by its holder as we opened it
                os.close(fd)
                continue
            self._fd = fd
            with contextlib.suppress(OSError):  # a full disk: the lock holds all the same
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())

    def check_free(self) -> None:
        """The "in use" ShardError when another shard train holds the lock now; takes nothing and
        makes no file (a start's first look at a run dir, before it decides what the folder holds)."""
        try:
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise self._in_use(os.read(fd, 200).decode(errors="replace").strip()) from None
        finally:
            os.close(fd)

    def _in_use(self, holder: str) -> ShardError:
        return ShardError(f"run dir {self.run_dir} is in use by another shard train ({holder or 'holder unknown'}); "
                          "wait for it to end, or choose another --run-dir")

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                (self.run_dir / LOCK_FILE).unlink()
            os.close(self._fd)
            self._fd = None
