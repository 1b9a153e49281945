"""Documents: the texts a token store (shard.data.store) or a tokenizer is made from.

A source is a path, a folder or a glob (`data/*.jsonl`, its files one source), or "" (the embedded
corpus). Its kind is its suffix: `.jsonl` (one document per row, its `text_field`), `.parquet` (the
`text_field` column), `.arrow` (a Hugging Face dataset file), a folder written by `save_to_disk` (its
"train" split when it holds several), and any other file is one text document.

The work is planned as chunks (`plan_chunks`) that a worker reads on its own (`read_chunk`): a group of
small text files, a byte range of a JSONL file cut at line ends, a Parquet row group, a range of a
dataset's rows; each about CHUNK_BYTES of text, in an order that depends on the sources alone."""

import dataclasses
import importlib
import json
from collections.abc import Iterator
from pathlib import Path

from shard.data.files import EMBEDDED, BadRow, Listing, json_row, list_source, read_text_bytes
from shard.data.tokenizers import lone_surrogate
from shard.errors import ShardError

TEXT, JSONL, PARQUET, DATASET = "text", "jsonl", "parquet", "dataset"
_KINDS = {".jsonl": JSONL, ".parquet": PARQUET, ".arrow": DATASET}  # by suffix; any other file is TEXT
MIN_CHUNK_BYTES = 256 << 10
CHUNK_BYTES = 8 << 20  # 8 MiB of text a chunk: a few seconds of one core, many chunks per worker
_STRING_TYPES = ("string", "large_string", "string_view")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One worker's share of the sources: `files` (text) or one file or folder read from `start` to
    `stop` (JSONL: bytes; Parquet: row groups; dataset: rows). `nbytes`: about how much text it holds;
    `source`: which of the sources given it is part of."""

    kind: str
    files: tuple[str, ...]
    start: int = 0
    stop: int = 0
    nbytes: int = 0
    source: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Chunk":
        return cls(d["kind"], tuple(d["files"]), d["start"], d["stop"], d["nbytes"], d["source"])


def need(module: str, path):
    """Import an optional (`data` extra) module, or a one-line ShardError naming what needed it: pyarrow
    and datasets are imported only when a source needs them."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ShardError(f"reading {path} needs {module.split('.')[0]} (./install.sh data)") from None


def source_parts(spec: str) -> list[tuple[str, Path]]:
    """The files (or dataset folder) of one source, each with its kind, in a fixed order."""
    return document_parts(list_source(spec))


def document_parts(listing: Listing) -> list[tuple[str, Path]]:
    """A listed source's files (or its dataset folder), each with its kind, in a fixed order: a folder's
    files all (its token files, if any, are read as text too)."""
    if listing.dataset:
        return [(DATASET, Path(listing.path))]
    files = sorted(listing.files + listing.unread)
    return [(_KINDS.get(f.suffix, TEXT), f) for f in files]


def plan_chunks(specs: list[str], text_field: str = "text", chunk_bytes: int = CHUNK_BYTES,
                parts: list | None = None) -> list[Chunk]:
    """Every source's chunks, sources in the order given; a source with no documents is an error.
    `parts`: each source's `document_parts` where the caller listed them already."""
    chunks = []
    for source, spec in enumerate(specs):
        label = "the embedded corpus" if spec == EMBEDDED else spec
        mine, group, size = [], [], 0
        parts_here = source_parts(spec) if parts is None else parts[source]
        # a small source still cuts into a few chunks, so that every worker has some (the cut depends on
        # the source alone, not on the workers)
        total = sum(path.stat().st_size for kind, path in parts_here if kind in (TEXT, JSONL))
        chunk_bytes = min(chunk_bytes, max(MIN_CHUNK_BYTES, total // 16))
        for kind, path in parts_here:
            if kind == TEXT:  # small files go together, one document each
                group.append(str(path))
                size += path.stat().st_size
                if size >= chunk_bytes:
                    mine.append(Chunk(TEXT, tuple(group), nbytes=size))
                    group, size = [], 0
                continue
            if group:
                mine.append(Chunk(TEXT, tuple(group), nbytes=size))
                group, size = [], 0
            if kind == JSONL:
                mine += _jsonl_chunks(path, chunk_bytes)
            elif kind == PARQUET:
                mine += _parquet_chunks(path, text_field)
            else:
                mine += _dataset_chunks(path, text_field, chunk_bytes)
        if group:
            mine.append(Chunk(TEXT, tuple(group), nbytes=size))
        if not mine:
            raise ShardError(f"data path {label} holds no documents")
        chunks += [dataclasses.replace(c, source=source) for c in mine]
    return chunks


def _jsonl_chunks(path: Path, chunk_bytes: int) -> list[Chunk]:
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + chunk_bytes < size:
            f.seek(cuts[-1] + chunk_bytes - 1)
            f.readline()  # to the end of the line the cut falls in
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return [Chunk(JSONL, (str(path),), a, b, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


def _parquet_chunks(path: Path, text_field: str) -> list[Chunk]:
    pq = need("pyarrow.parquet", path)
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet vary
        raise ShardError(f"cannot read Parquet file {path}: {str(e).splitlines()[0][:160]}") from None
    schema = meta.schema_arrow
    if text_field not in schema.names:
        raise ShardError(f"Parquet file {path} has no column {text_field!r} (its columns: "
                         f"{', '.join(schema.names)}); give --text-field")
    kind = schema.field(text_field).type
    if not _is_text(kind):
        raise ShardError(f"column {text_field!r} of Parquet file {path} is {kind}, not text")
    column = schema.names.index(text_field)
    groups = meta.metadata
    return [Chunk(PARQUET, (str(path),), g, g + 1, groups.row_group(g).column(column).total_uncompressed_size)
            for g in range(groups.num_row_groups) if groups.row_group(g).num_rows]


def _is_text(kind) -> bool:
    """A column of strings, plain or dictionary-encoded (pandas' categoricals, Parquet's dictionary pages
    read back as such): both read as Python strings."""
    kind = getattr(kind, "value_type", kind)  # a dictionary's values
    return str(kind) in _STRING_TYPES


def open_dataset(path: Path):
    """A saved Hugging Face dataset (a save_to_disk folder, its "train" split for a DatasetDict, or an
    .arrow file), memory-mapped."""
    datasets = need("datasets", path)
    state = path / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files", [None]):
        raise ShardError(f"data path {path} holds no documents")  # datasets can't load a saved empty one
    try:
        ds = datasets.Dataset.from_file(str(path)) if path.is_file() else datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a folder it can't read
        raise ShardError(f"cannot read the dataset {path}: {str(e).splitlines()[0][:160]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ShardError(f"dataset {path} holds the splits {', '.join(ds)} and no 'train'; give one split's "
                             "folder")
        ds = ds["train"]
    return ds


def _dataset_chunks(path: Path, text_field: str, chunk_bytes: int) -> list[Chunk]:
    ds = open_dataset(path)
    if text_field not in ds.column_names:
        raise ShardError(f"dataset {path} has no column {text_field!r} (its columns: {', '.join(ds.column_names)}); "
                         "give --text-field")
    kind = ds.data.schema.field(text_field).type
    if not _is_text(kind):
        raise ShardError(f"column {text_field!r} of dataset {path} is {kind}, not text")
    rows = len(ds)
    nbytes = ds.data.column(text_field).nbytes
    step = max(1, int(rows * chunk_bytes / max(nbytes, 1)))
    return [Chunk(DATASET, (str(path),), a, min(a + step, rows), nbytes * (min(a + step, rows) - a) // rows)
            for a in range(0, rows, step)]


def read_chunk(chunk: Chunk, text_field: str = "text") -> list[str]:
    """The chunk's documents, empty ones included (the store skips them)."""
    return read_chunk_counted(chunk, text_field)[0]


def read_chunk_counted(chunk: Chunk, text_field: str = "text") -> tuple[list[str], dict[str, int]]:
    """read_chunk, and the text files in which invalid UTF-8 became U+FFFD, with how many sequences."""
    if chunk.kind == TEXT:
        decoded = {f: decode_text(read_text_bytes(Path(f))) for f in chunk.files}
        return [t for t, _ in decoded.values()], {f: n for f, (_, n) in decoded.items() if n}
    return _read_rows(chunk, text_field), {}


def _read_rows(chunk: Chunk, text_field: str) -> list[str]:
    path = Path(chunk.files[0])
    if chunk.kind == JSONL:
        return _read_jsonl(path, chunk.start, chunk.stop, text_field)
    if chunk.kind == PARQUET:
        pq = need("pyarrow.parquet", path)
        table = pq.ParquetFile(path).read_row_group(chunk.start, columns=[text_field])
        return [t or "" for t in table.column(0).to_pylist()]
    ds = open_dataset(path)
    return [t or "" for t in ds[chunk.start:chunk.stop][text_field]]


def decode_text(raw: bytes) -> tuple[str, int]:
    """UTF-8 text, each invalid sequence replaced by U+FFFD, and how many were (U+FFFD written in the
    file itself is no replacement)."""
    text = raw.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def _read_jsonl(path: Path, start: int, stop: int, text_field: str) -> list[str]:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(stop - start)
    texts = []
    for n, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            row = json_row(line)
            texts.append(row[text_field])
        except (BadRow, KeyError, TypeError, IndexError) as e:
            raise ShardError(_jsonl_error(path, start, n, text_field, e)) from None
        if not isinstance(texts[-1], str):
            raise ShardError(f"{path} line {_line_number(path, start, n)}: field {text_field!r} is "
                             f"{type(texts[-1]).__name__}, not text")
        if problem := lone_surrogate(texts[-1]):
            raise ShardError(f"{path} line {_line_number(path, start, n)}: field {text_field!r} holds {problem}")
    return texts


def _line_number(path: Path, start: int, n: int) -> int:
    with open(path, "rb") as f:
        return f.read(start).count(b"\n") + n + 1


def _jsonl_error(path: Path, start: int, n: int, field: str, e: Exception) -> str:
    where = f"{path} line {_line_number(path, start, n)}"
    if isinstance(e, BadRow):
        return f"{where} {e}"
    return f"{where} has no field {field!r} (give --text-field)"


def iter_documents(specs: list[str], text_field: str = "text") -> Iterator[str]:
    """Every non-empty document of the sources, in order (for training a tokenizer)."""
    for chunk in plan_chunks(specs, text_field):
        yield from (t for t in read_chunk(chunk, text_field) if t)
