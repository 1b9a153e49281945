"""Windows of tokens, their order, and the global batch.

Each sample is a window of seq_len + 1 tokens; grain shuffles the windows from a seed and reshuffles
every epoch. The stream's position is a global sample index: step k reads samples [k*B, (k+1)*B), and
each process materialises only the rows its devices hold. So the stream is the same on any mesh or
process count.
"""

from dataclasses import dataclass

import numpy as np

from shard.data.sources import SYNTHETIC, TokenParts, load_tokens
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
            windows = self.tokens.ranges(starts, self.seq_len + 1).astype(np.int32)
        else:
            windows = np.asarray(self.tokens[np.minimum(offsets, self.tokens.size - 1)], dtype=np.int32)
        return np.where(inside, windows, -1).astype(np.int32)


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
    """The training samples: an infinite, seeded sequence of (seq_len + 1)-token windows.

    grain orders them (a fresh shuffle of the source's windows every epoch); the source reads a whole
    block of rows with one vectorized gather. (Reading row by row through grain's MapDataset costs
    ~75 us a row in its per-element bookkeeping: 1.2 ms of host time per 16-row batch.)
    """

    def __init__(self, source, order):  # a grain.MapDataset of row indices, or None
        self.source, self.order = source, order  # order None: the source's own order (synthetic)

    @property
    def windows(self) -> int | None:
        """Distinct windows the source holds (None: unbounded, synthetic)."""
        return len(self.source) if isinstance(self.source, WindowSource) else None

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows(i, i + 1)[0]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Samples [start, stop) as a (stop - start, seq_len + 1) int32 array."""
        if self.order is None:
            indices = np.arange(start, stop)
        else:
            indices = np.fromiter((self.order[i] for i in range(start, stop)), np.int64, stop - start)
        return self.source.read(indices)


def sample_dataset(path: str, vocab_size: int, seq_len: int, seed: int, *, holdout: float = 0.0,
                   part: str = "all") -> Samples:
    """An infinite, seeded, random-access dataset of (seq_len + 1)-token windows.

    With `holdout`, the source's windows split in two: `part="train"` reads all but the last `holdout`
    share of them, `part="eval"` only those (held out: training never sees them); synthetic data has no
    split (each seed gives fresh tokens)."""
    if path == SYNTHETIC:
        return Samples(SyntheticSource(vocab_size, seq_len, seed), None)
    tokens = load_tokens(path, vocab_size)
    if holdout and part != "all":
        tokens = _split(tokens, seq_len, holdout, path)[part == "eval"]
    return _shuffled(WindowSource(tokens, seq_len), seed)


def _split(tokens: np.ndarray, seq_len: int, holdout: float, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last `holdout` share of the windows, at least one, is
    held out, cut on a window boundary."""
    windows = len(WindowSource(tokens, seq_len))
    held = max(1, round(windows * holdout))
    if held >= windows:
        raise ShardError(f"data {path or 'corpus'} holds {windows} window(s) of {seq_len + 1} tokens: too few "
                         f"to hold out eval.holdout={holdout:g} of them for evaluation; give eval.path, or more "
                         "data, or a shorter --seq")
    cut = (windows - held) * seq_len
    return tokens[:cut], tokens[cut:]


def _shuffled(source: "WindowSource", seed: int) -> Samples:
    import grain  # here, not at the top: synthetic data never needs it

    return Samples(source, grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat())


def repetition_note(samples: Samples, global_batch: int, seq_len: int) -> str | None:
    """A line when the data holds fewer distinct windows than one global batch, else None."""
    n = samples.windows
    if n is None or n >= global_batch:
        return None
    return (f"the training data holds {n} window(s) of {seq_len + 1} tokens, fewer than one global batch of "
            f"{global_batch}: every batch repeats them")


def held_out_share(cfg) -> float:
    """The share of data.path's windows a TrainConfig keeps from training (for evaluation), 0 for none
    (synthetic data holds nothing out: evaluation draws fresh tokens)."""
    return cfg.eval.holdout if cfg.eval.every and not cfg.eval.path and cfg.data.path != SYNTHETIC else 0.0


def training_samples(cfg) -> Samples:
    """The training data of a TrainConfig: data.path, less the held-out tail when evaluation takes it."""
    return sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed,
                          holdout=held_out_share(cfg), part="train")


def eval_samples(cfg) -> Samples:
    """The held-out data of a TrainConfig: eval.path, or data.path's held-out tail."""
    seed = (cfg.seed + 1) % 2**32  # another order than training's, within grain's seed range
    if cfg.eval.path:
        try:
            return sample_dataset(cfg.eval.path, cfg.model.vocab_size, cfg.data.seq_len, seed)
        except ShardError as e:  # said as the held-out data's, not the training data's
            raise ShardError(f"eval.path: {e}") from None
    return sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, seed,
                          holdout=cfg.eval.holdout, part="eval")


def split_window(windows: np.ndarray) -> dict[str, np.ndarray]:
    """(rows, T+1) windows -> next-token inputs, targets and a loss mask (0 where padded)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    mask = (targets >= 0).astype(np.float32)
    return {"inputs": np.maximum(inputs, 0), "targets": np.maximum(targets, 0), "mask": mask}


@dataclass
class BatchStream:
    """Global batches as sharded jax.Arrays; `position` (the next global sample index) is the state."""

    dataset: Samples
    global_batch: int
    seq_len: int
    sharding: object  # NamedSharding for (batch, length)
    position: int = 0
    # With the MPI bridge each process builds only its own block of rows [offset, offset + rows) of
    # every global batch, as an array over its local mesh. Default: the whole global batch.
    offset: int = 0
    rows: int | None = None

    def next(self) -> dict:
        import jax

        n_rows = self.global_batch if self.rows is None else self.rows
        shape = (n_rows, self.seq_len)
        first = self.position + self.offset
        cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

        def rows(start: int, stop: int) -> dict[str, np.ndarray]:
            if (start, stop) not in cache:
                cache[(start, stop)] = split_window(self.dataset.rows(first + start, first + stop))
            return cache[(start, stop)]

        def make(key):
            def callback(index):
                r = index[0]
                start, stop, _ = r.indices(n_rows)
                return rows(start, stop)[key][:, index[1]]

            return jax.make_array_from_callback(shape, self.sharding, callback)

        batch = {k: make(k) for k in ("inputs", "targets", "mask")}
        self.position += self.global_batch
        return batch
