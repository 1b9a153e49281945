"""What a data path holds on disk, before anything is decided about it: the embedded corpus (the
Python standard library's own top-level modules, present on every machine with Python), a file, a
folder or a glob's files, whether it is a token store's or a saved dataset's folder; and reading
files as tokens as they are: pre-tokenized `.npy`/`.bin` arrays (`.bin` is raw uint16, nanoGPT's
format), or text as its UTF-8 bytes. shard.data.sources decides from a `Listing` what a path is."""

import glob
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.data.tokenizers import BYTE_VOCAB
from shard.errors import ShardError

EMBEDDED = ""
TOKEN_SUFFIXES = (".npy", ".bin")
STORE_FORMAT = "shard-token-store"
STORE_FILE = "store.json"  # a token store's folder holds it (shard.data.store)
_DATASET_MARKS = ("dataset_dict.json", "state.json")  # what save_to_disk writes in a folder


class BadRow(ValueError):
    """Why a JSON Lines row can't be read: the rest of a line that starts `FILE line N`."""


def json_row(line: bytes):
    """One JSON Lines row, parsed; a BadRow when it is not JSON (or not UTF-8), or is nested deeper than
    Python's recursion limit allows (about 1,000 levels)."""
    try:
        return json.loads(line)
    except RecursionError:
        raise BadRow("is nested too deeply to read (arrays or objects about 1,000 levels deep)") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise BadRow(f"is not JSON ({str(e)[:120]})") from None


def embedded_corpus_files() -> list[Path]:
    """The standard library's top-level modules: ~4.7 MB of real text on Python 3.11."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_store(path) -> bool:
    """Whether `path` is a token store's folder (a whole one: a partial has no store.json)."""
    f = Path(path) / STORE_FILE
    try:
        return f.is_file() and json.loads(f.read_text(encoding="utf-8")).get("format") == STORE_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def is_dataset_folder(path: Path) -> bool:
    """A folder written by a Hugging Face dataset's save_to_disk."""
    return path.is_dir() and any((path / mark).is_file() for mark in _DATASET_MARKS)


def is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def glob_files(pattern: str) -> list[Path]:
    """The regular files a glob pattern matches, sorted (the same order on every host); none is an error."""
    files = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
    if not files:
        raise ShardError(f"data path {pattern} matches no file")
    return files


def folder_sources(folder: Path) -> tuple[list[Path], list[Path]]:
    """A data folder's token files (.npy/.bin) and its other files, sorted; not those under hidden
    folders (.git/, .cache/) or __pycache__/. Linked folders are followed (each real folder once); a
    link to nothing is an error, not a file left out in silence.
    Token files win: the others are read only when there are none."""
    files, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree, or a second link to one folder
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")  # the same on every host
        visible = [Path(root, n) for n in names if not n.startswith(".")]
        if broken := next((f for f in visible if f.is_symlink() and not f.exists()), None):  # data gone missing
            raise ShardError(f"data folder {folder}: {broken} links to {os.readlink(broken)}, which does not exist")
        files += [f for f in visible if f.is_file()]
    files.sort()
    return [f for f in files if f.suffix in TOKEN_SUFFIXES], [f for f in files if f.suffix not in TOKEN_SUFFIXES]


@dataclass(frozen=True)
class Listing:
    """What a data path holds, listed once. `found`: the files it reads (a folder's token files when it
    holds any, else its other files); `problem`: why they can't be listed (the path is missing, a glob
    matches nothing, a link leads nowhere), raised by `files` where they are needed, not before."""

    path: str
    found: tuple[Path, ...] = ()
    tokens: bool = False  # `found` are token arrays (.npy/.bin), not text
    unread: tuple[Path, ...] = ()  # a folder's other files, when `found` are its token files
    folder: bool = False
    store: bool = False  # a token store's folder
    dataset: bool = False  # a saved Hugging Face dataset's folder
    problem: str = ""

    @property
    def files(self) -> tuple[Path, ...]:
        if self.problem:
            raise ShardError(self.problem)
        return self.found

    @property
    def root(self) -> Path | None:
        """What its files are named relative to in a signature: the folder, if it is one."""
        return Path(self.path) if self.folder else None


def list_source(path: str) -> Listing:
    """The files of a data path (a file, a folder, a glob or the embedded corpus) and the marks of its
    folder; never raises: a path that names no files keeps the reason as its `problem`."""
    if path == EMBEDDED:
        return Listing(path, tuple(embedded_corpus_files()))
    p = Path(path)
    folder = p.is_dir()
    marks = dict(folder=folder, store=folder and is_store(p), dataset=is_dataset_folder(p))
    try:
        if not p.exists() and is_glob(path):  # data/*.jsonl: the files it matches are one source
            files = glob_files(path)
            return Listing(path, tuple(files), all(f.suffix in TOKEN_SUFFIXES for f in files), **marks)
        if not p.exists():
            raise ShardError(f"data path {path} does not exist")
        if folder:
            tokens, others = folder_sources(p)
            if tokens:
                return Listing(path, tuple(tokens), True, tuple(others), **marks)
            return Listing(path, tuple(others), **marks)
        if not p.is_file():
            raise ShardError(f"data path {path} is not a regular file or folder")
    except ShardError as e:
        return Listing(path, problem=str(e), **marks)
    return Listing(path, (p,), p.suffix in TOKEN_SUFFIXES, **marks)


def read_text_bytes(path: Path, instead: str = "give text files") -> bytes:
    """A text file's bytes; one that looks binary is an error ending with `instead` (what to give)."""
    data = path.read_bytes()
    if b"\0" in data[:65536]:  # text has no NUL bytes; images, archives and executables do
        raise ShardError(f"data file {path} looks binary (it holds NUL bytes); {instead}")
    return data


def files_signature(files, root: Path | None = None) -> str:
    """Each file's name (relative to `root`, else its bare name), size and a CRC of its first and last
    4 KiB, one line each."""
    lines = []
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as handle:
            crc = zlib.crc32(handle.read(1 << 12))
            if size > 1 << 12:
                handle.seek(max(1 << 12, size - (1 << 12)))
                crc = zlib.crc32(handle.read(), crc)
        lines.append(f"{f.relative_to(root) if root else f.name} {size} {crc:08x}")
    return "\n".join(lines)


def load_tokens(path: str, vocab_size: int) -> np.ndarray:
    """One long 1-D token stream from the files at `path` (shard.data.sources reads a described
    source's with `read_listed`)."""
    return read_listed(list_source(path), vocab_size)


def read_listed(listing: Listing, vocab_size: int) -> np.ndarray:
    """One long 1-D token stream from a listing's files. The last one read is kept while its files are
    unchanged (`_identity`): training and its held-out tail read one copy."""
    path = listing.path
    label = "the embedded corpus" if path == EMBEDDED else str(Path(path))
    files = listing.files
    key = (path, vocab_size, tuple((str(f), *_identity(f.stat())) for f in files))
    if key not in _LAST_READ:
        _LAST_READ.clear()
        _LAST_READ[key] = _read_tokens(list(files), listing.tokens, label, vocab_size)
    return _LAST_READ[key]


_LAST_READ: dict = {}


def _identity(st: os.stat_result) -> tuple:
    """A file as it is now: another file, or this one rewritten (even to its old size and time), differs."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_tokens(files: list[Path], token_files: bool, label: str, vocab_size: int):
    if not files:
        tokens = np.zeros(0, np.uint8)
    elif token_files:
        tokens = _read_token_file(files[0]) if len(files) == 1 else TokenParts([_read_token_file(f) for f in files])
    else:
        tokens = _read_text_files(files)
    if tokens.size < 2:
        raise ShardError(f"data path {label} is empty" if tokens.size == 0 else
                         f"data path {label} holds 1 token: training needs at least 2 (an input and its target)")
    if not token_files and vocab_size < BYTE_VOCAB:
        raise ShardError(f"text is tokenized as bytes (256 ids) but model.vocab_size is {vocab_size}")
    top, bottom = int(tokens.max()), int(tokens.min())
    if top >= vocab_size or bottom < 0:
        raise ShardError(f"data {label} holds token id {top if top >= vocab_size else bottom}, outside "
                         f"0..{vocab_size - 1} (model.vocab_size {vocab_size})")
    return tokens


def _read_text_files(files: list[Path]) -> np.ndarray:
    texts = [read_text_bytes(f, "give text files, or tokens as .npy/.bin") for f in files]
    return np.frombuffer(b"\n".join(texts), dtype=np.uint8)


def _read_token_file(path: Path) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            with open(path, "rb") as f:
                magic = f.read(6)
            if magic[:2] == b"PK":  # numpy.savez's zip archive
                raise ShardError(f"token file {path} is an archive of arrays, not one .npy array")
            if magic != b"\x93NUMPY":  # numpy would try it as a pickle, and say so
                raise ShardError(f"token file {path} is not an .npy array (no NUMPY header): write it with "
                                 "numpy.save, or name raw uint16 tokens .bin")
            tokens = np.load(path, mmap_mode="r")
        elif path.stat().st_size == 0:  # an empty shard: numpy can't map it
            tokens = np.zeros(0, np.uint16)
        else:
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
    except (ValueError, OSError) as e:
        raise ShardError(f"cannot read token file {path}: {e}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ShardError(f"token file {path}: expected a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    return tokens


class TokenParts:
    """Token files (memory-mapped) read as one stream without copying them into memory: a folder of
    .bin/.npy shards, the usual form of a large corpus, costs page cache, not private memory per
    process. Supports what the windows need: `size`, `dtype`, a contiguous slice, `ranges` (rows of
    consecutive tokens), `min()`/`max()`. A token store's carry its `vocab` (ids are below it) and its
    `label`, which the rows read from them are checked against (shard.data.samples.check_ids)."""

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None, *,
                 vocab: int | None = None, label: str = ""):
        self.parts, self.vocab, self.label = parts, vocab, label
        self.bounds = np.cumsum([0, *(p.size for p in parts)])  # where each part starts in the stream
        self.start = start
        self.stop = int(self.bounds[-1]) if stop is None else stop
        self.size = self.stop - self.start
        self.dtype = np.result_type(*(p.dtype for p in parts))

    def __getitem__(self, key: slice) -> "TokenParts":
        first, last, step = key.indices(self.size)
        if step != 1:
            raise ValueError("TokenParts slices with step 1 only")
        return TokenParts(self.parts, self.start + first, self.start + max(first, last), vocab=self.vocab,
                          label=self.label)

    def ranges(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of `length` consecutive tokens from each start (past the end: the last token repeated),
        copied slice by slice: a window spans one shard or a few, so this costs a copy, not a gather."""
        out = np.empty((len(starts), length), self.dtype)
        for row, first in enumerate(np.asarray(starts, np.int64) + self.start):
            end, filled = min(first + length, self.stop), 0
            k = int(np.searchsorted(self.bounds, first, side="right")) - 1
            while first < end:
                take = min(end, int(self.bounds[k + 1])) - first
                out[row, filled:filled + take] = self.parts[k][first - self.bounds[k]:first - self.bounds[k] + take]
                filled, first, k = filled + take, first + take, k + 1
            out[row, filled:] = out[row, filled - 1] if filled else 0
        return out

    def _pieces(self):
        for k, p in enumerate(self.parts):
            lo, hi = max(self.start - self.bounds[k], 0), min(self.stop - self.bounds[k], p.size)
            if lo < hi:
                yield p[lo:hi]

    def max(self):
        return max(piece.max() for piece in self._pieces())

    def min(self):
        return min(piece.min() for piece in self._pieces())

    def __array__(self, dtype=None, copy=None):
        joined = np.concatenate(list(self._pieces())) if self.size else np.zeros(0, self.dtype)
        return joined.astype(dtype) if dtype is not None else joined
