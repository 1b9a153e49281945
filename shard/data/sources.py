"""What a data path is, decided once: `describe_data` turns a `--data` value into a `DataSource`, and
everything that reads the data (shard.data.corpus, .batches, .store, the run's tokenizer) takes that
description rather than looking at the path again.

- `synthetic`: uniform random tokens, no files;
- a token store (`shard data prepare`'s folder): read as it is, with its own tokenizer by default;
- a mixture (`.toml`): its sources, each described, all read with one tokenizer (the first store's);
- token arrays (`.npy`/`.bin`, or a folder or glob of them): read as they are;
- text read as UTF-8 bytes (the byte tokenizer on text files or the embedded corpus, in windows);
- raw sources (JSON Lines, Parquet, saved datasets, a glob; text with another tokenizer or packed):
  prepared once into a store in the data cache.
"""

from dataclasses import dataclass
from pathlib import Path

from shard.data.documents import TEXT, document_parts
from shard.data.files import EMBEDDED, Listing, files_signature, list_source
from shard.data.files import is_glob  # noqa: F401 - where callers find it (shard.run.start)
from shard.data.mixture import is_mixture, read_mixture
from shard.data.tokenizers import BYTE
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR

SYNTHETIC = "synthetic"
STORE, MIXTURE, TOKENS, BYTES, RAW = "store", "mixture", "tokens", "bytes", "raw"


@dataclass(frozen=True)
class MixturePart:
    source: "DataSource"
    weight: float
    epochs: float = 0.0  # 0: no cap


@dataclass(frozen=True)
class DataSource:
    """A data path as a run reads it. `kind`: SYNTHETIC, STORE, MIXTURE, TOKENS, BYTES or RAW (see the
    module's docstring); `tokenizer`: the spec all of it is read with, resolved once (data.tokenizer when
    given, else a store's own, else bytes); `listing`: its files (all but synthetic data); `mixture`: a
    mixture's sources. What could not be read is kept (`listing.problem`, `problem`) and raised where it
    is needed, as reading the data would."""

    kind: str
    path: str
    tokenizer: str
    text_field: str = "text"
    packing: str = "concat"
    listing: Listing | None = None
    mixture: tuple[MixturePart, ...] = ()
    problem: str = ""  # a mixture file not read (its tokenizer was given): raised by `parts`

    @property
    def label(self) -> str:
        return "the embedded corpus" if self.path == EMBEDDED else self.path

    @property
    def parts(self) -> tuple[MixturePart, ...]:
        """A mixture's sources."""
        if self.problem:
            raise ShardError(self.problem)
        return self.mixture

    @property
    def documents(self) -> list[tuple[str, Path]]:
        """Its files (or saved dataset) as documents, each with its kind (shard.data.documents); the path
        `synthetic` given as a source of documents (shard data prepare) is a file's name there."""
        return document_parts(self.listing or list_source(self.path))

    @property
    def file_count(self) -> int | None:
        """How many files it reads (None: a saved dataset, whose files are not the user's, or none listed)."""
        listing = self.listing
        return None if listing is None or listing.dataset or listing.problem else len(listing.found)


def describe_data(path: str, *, tokenizer: str = "", text_field: str = "text",
                  packing: str = "concat") -> DataSource:
    """The one look at a data path: what it is, its files, and the tokenizer it is read with. Raises only
    what stops the tokenizer from being known (a mixture file that can't be read, with none given)."""
    if path == SYNTHETIC:
        return DataSource(SYNTHETIC, path, tokenizer or BYTE, text_field, packing)
    listing = list_source(path)
    if not is_mixture(path):
        return _described(listing, tokenizer or _own_tokenizer(listing), text_field, packing)
    try:
        entries = read_mixture(path)
    except ShardError as e:
        if not tokenizer:
            raise
        return DataSource(MIXTURE, path, tokenizer, text_field, packing, listing, problem=str(e))
    listings = [None if e.path == SYNTHETIC else list_source(e.path) for e in entries]
    # one tokenizer for all of it: a mixture's sources are read (or checked) with the first store's
    spec = tokenizer or next((_own_tokenizer(x) for x in listings if x is not None and x.store), BYTE)
    parts = tuple(MixturePart(DataSource(SYNTHETIC, e.path, spec, text_field, packing) if x is None else
                              _described(x, spec, text_field, packing), e.weight, e.epochs)
                  for e, x in zip(entries, listings))
    return DataSource(MIXTURE, path, spec, text_field, packing, listing, parts)


def _own_tokenizer(listing: Listing) -> str:
    return str(Path(listing.path) / TOKENIZER_DIR) if listing.store else BYTE


def _described(listing: Listing, tokenizer: str, text_field: str, packing: str) -> DataSource:
    return DataSource(_kind(listing, tokenizer, packing), listing.path, tokenizer, text_field, packing, listing)


def _kind(listing: Listing, tokenizer: str, packing: str) -> str:
    """How a listed path (neither synthetic nor a mixture) is read."""
    embedded = listing.path == EMBEDDED
    files = not embedded and not listing.store and not listing.dataset  # files, a folder or a glob of them
    if files and not listing.problem and listing.tokens:
        return TOKENS
    if tokenizer == BYTE and packing == "concat":  # text in windows of its bytes: nothing to prepare
        if embedded:
            return BYTES
        # a file or folder (not a glob) of text; one whose files can't be listed is read so too, which says why
        if files and Path(listing.path).exists() and (
                listing.problem or all(kind == TEXT for kind, _ in document_parts(listing))):
            return BYTES
    return STORE if listing.store else RAW


def data_source(cfg) -> DataSource:
    """The description of a TrainConfig's data (data.path read with data.tokenizer, text field, packing)."""
    data = cfg.data
    return describe_data(data.path, tokenizer=data.tokenizer, text_field=data.text_field, packing=data.packing)


def source_signature(source: DataSource) -> str:
    """What the data is, cheaply: each file's name, size and a CRC of its first and last 4 KiB (a
    mixture: its file's and each source's). Processes of one job compare theirs (shard.run.agreement):
    the same path can hold other data on another host."""
    if source.kind == SYNTHETIC:
        return SYNTHETIC
    if source.kind == MIXTURE:  # its file and each of its sources
        parts = [source_signature(p.source) for p in source.parts]
        return "\n".join([files_signature([Path(source.path)]), *parts])
    return files_signature(source.listing.files, source.listing.root)


def unused_files_note(source: DataSource) -> str | None:
    """A line naming the files a folder of token files leaves unread, or None."""
    listing = source.listing
    if listing is None or not listing.folder or listing.store:  # a token store: all of it is read
        return None
    tokens, others, p = listing.files, listing.unread, Path(source.path)
    if not listing.tokens or not others:
        return None
    return (f"data folder {p} holds {len(tokens)} token file(s) (.npy/.bin), so its {len(others)} other file(s) "
            f"are not read (e.g. {others[0].relative_to(p)})")
