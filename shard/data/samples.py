"""Samples: rows of seq_len + 1 tokens (windows of a token stream, packed documents, synthetic tokens)
and the seeded order they are read in. The stream's position is a global sample index, and sample i is
a pure function of the seed and i, so the same on any mesh or process count (shard.data.batches makes
the global batch of them)."""

import numpy as np

from shard.data.files import TokenParts
from shard.data.packing import PackedSource
from shard.errors import ShardError


class WindowSource:
    """Random access to non-overlapping windows of seq_len + 1 tokens (the last one padded)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self._n = max(1, -(-(tokens.size - 1) // seq_len))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(np.array([i]))[0]

    def read(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) windows in one gather; -1 pads past the end (masked from the loss)."""
        starts = (np.asarray(indices, np.int64) % self._n) * self.seq_len
        offsets = starts[:, None] + np.arange(self.seq_len + 1)
        inside = offsets < self.tokens.size
        if isinstance(self.tokens, TokenParts):  # shards: a copy per window, not a gather across them
            stored = self.tokens.ranges(starts, self.seq_len + 1)
            check_ids(self.tokens, stored)  # as stored: a uint32 id of 2**31 or more is negative as int32
            windows = stored.astype(np.int32)
        else:
            windows = np.asarray(self.tokens[np.minimum(offsets, self.tokens.size - 1)], dtype=np.int32)
        return np.where(inside, windows, -1).astype(np.int32)


def check_ids(tokens, ids: np.ndarray, padding: np.ndarray | None = None) -> None:
    """Rows of ids read from a token store's `tokens` (TokenParts with a `vocab`; anything else was
    checked whole when read) checked against its vocabulary: a max and a min (or a count of the negative
    ids) over the rows a batch reads, so an id a damaged shard holds stops the run, in one line, before a
    step sees it. (A store's recorded max_token is not proof, and opening one reads no shard whole.)
    `padding`: where the rows hold -1 for no token (packed rows)."""
    vocab = getattr(tokens, "vocab", None)
    if vocab is None or not ids.size:
        return
    top = int(ids.max())
    # int32 rows: a uint32 id of 2**31 or more reads as negative, even as -1, which is also padding
    wrapped = int(ids.min()) < 0 if padding is None else np.count_nonzero(ids < 0) != np.count_nonzero(padding)
    if top >= vocab or wrapped:
        bad = top if top >= vocab else int(ids[(ids < 0) if padding is None else (ids < 0) & ~padding][0]) % 2**32
        raise ShardError(f"{tokens.label} holds token id {bad:,}, outside its vocabulary of {vocab:,} ids (found in "
                         "the rows of a batch): the store is damaged; prepare it again")


class SyntheticSource:
    """Uniform random tokens, a pure function of (seed, index): for benchmarks. A counter-based hash
    (splitmix64) of (seed, index, position), so reading a batch costs one vectorized expression."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(np.array([i]))[0]

    def read(self, indices: np.ndarray) -> np.ndarray:
        width = self.seq_len + 1
        counters = np.asarray(indices, np.uint64)[:, None] * np.uint64(width) + np.arange(width, dtype=np.uint64)
        bits = _splitmix64(counters ^ _splitmix64(np.array([self.seed], np.uint64)))
        return (bits % np.uint64(self.vocab_size)).astype(np.int32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class Samples:
    """The training samples: an infinite, seeded sequence of rows of seq_len + 1 tokens (windows, or
    packed rows of whole documents: shard.data.packing).

    grain orders them (a fresh shuffle of the source's rows every epoch); the source reads a whole
    block of rows with one vectorized gather. (Reading row by row through grain's MapDataset costs
    ~75 us a row in its per-element bookkeeping: 1.2 ms of host time per 16-row batch.)
    """

    loss_masked = False  # its batches carry a `loss_mask` (fine-tuning: shard.data.finetune)

    def __init__(self, source, order, seq_len: int | None = None, *, files: int | None = None,
                 documents: int | None = None, origin=None):  # order: a grain.MapDataset of row indices
        self.source, self.order = source, order  # order None: the source's own order (synthetic)
        self.seq_len = seq_len if seq_len is not None else getattr(source, "seq_len", None)
        self.files, self.documents = files, documents  # what was read, where known
        self.origin = origin  # the shard.data.sources.DataSource read (None: made by hand)

    @classmethod
    def shuffled(cls, source, seed: int, seq_len: int, corpus=None, origin=None):
        """The rows of `source` in a fresh seeded shuffle every epoch; `corpus` (a shard.data.corpus.Corpus)
        says how many files and documents they were read from."""
        ends = getattr(corpus, "document_ends", None)
        return cls(source, shuffled_order(len(source), seed), seq_len, files=getattr(corpus, "files", None),
                   documents=None if ends is None else len(ends), origin=origin)

    @property
    def windows(self) -> int | None:
        """Distinct rows the source holds (None: unbounded, synthetic)."""
        return len(self.source) if isinstance(self.source, WindowSource | PackedSource) else None

    @property
    def packed(self) -> bool:
        return isinstance(self.source, PackedSource)

    @property
    def tokens(self) -> int | None:
        """Tokens the source holds (None: unbounded, synthetic)."""
        held = getattr(self.source, "tokens", None)
        return None if held is None else int(held.size)

    def describe(self) -> str:
        """`3 files, 1,200 documents, 1,234,567 tokens in 9,645 packed rows (98.7% filled)` for start-up
        summaries (files and documents where they are known)."""
        if self.windows is None:
            return "synthetic tokens"
        read = "".join(f"{n:,} {word}{'s' if n != 1 else ''}, " for n, word in
                       ((self.files, "file"), (self.documents, "document")) if n is not None)
        if self.packed:
            return (f"{read}{self.tokens:,} tokens in {self.windows:,} packed rows "
                    f"({self.source.plan.efficiency:.1%} filled)")
        return f"{read}{self.tokens:,} tokens in {self.windows:,} windows"

    def __getitem__(self, i: int):
        rows = self.rows(i, i + 1)
        return {k: v[0] for k, v in rows.items()} if isinstance(rows, dict) else rows[0]

    def rows(self, start: int, stop: int):
        """Samples [start, stop): a (stop - start, seq_len + 1) int32 array of windows, or packed rows
        (a dict of such arrays: tokens, segments, positions)."""
        return self.rows_at(np.arange(start, stop))

    def _indices(self, samples: np.ndarray) -> np.ndarray:
        if self.order is None:
            return np.asarray(samples, np.int64)
        return np.fromiter((self.order[int(i)] for i in samples), np.int64, len(samples))

    def rows_at(self, samples: np.ndarray):
        """Rows of these sample indices (not necessarily consecutive)."""
        rows = self.source.read(self._indices(samples))
        if isinstance(rows, dict) and "segments" in rows:  # packed rows (windows are checked as they are read)
            check_ids(getattr(self.source, "tokens", None), rows["tokens"], padding=rows["segments"] == 0)
        return rows

    def filled_at(self, samples: np.ndarray) -> int:
        """Input tokens these samples hold that are not padding (packed rows); all of them otherwise."""
        if not self.packed:
            return len(samples) * self.seq_len
        return int(np.minimum(self.source.filled(self._indices(samples)), self.seq_len).sum())

    def filled(self, start: int, stop: int) -> int:
        return self.filled_at(np.arange(start, stop))


def join_rows(parts: list[tuple[np.ndarray, object]], n: int):
    """Rows read in groups (where each group's rows go, the rows) put back in order: arrays, or dicts of them."""
    first = parts[0][1]
    if isinstance(first, dict):
        return {k: join_rows([(w, r[k]) for w, r in parts], n) for k in first}
    out = np.empty((n, *first.shape[1:]), first.dtype)
    for where, rows in parts:
        out[where] = rows
    return out


def shuffled_order(n: int, seed: int):
    """Indices 0..n-1 in a fresh shuffle every epoch, from the seed: an infinite grain MapDataset."""
    import grain  # here, not at the top: over a second to import, and synthetic data never needs it

    return grain.MapDataset.range(n).shuffle(seed=seed).repeat()
