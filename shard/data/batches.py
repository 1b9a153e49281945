"""Rows of tokens, their order, and the global batch.

Each sample is a row of seq_len + 1 tokens: a window of the token stream (data.packing = "concat"), or
whole documents packed with their segment ids and positions ("packed", shard.data.packing); a mixture
draws rows from several sources (shard.data.mixture). grain shuffles the rows from a seed and
reshuffles every epoch. The stream's position is a global sample index: step k reads samples [k*B, (k+1)*B), and
each process materialises only the rows its devices hold. So the stream is the same on any mesh or
process count.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np

from shard.data.corpus import data_cache_dir, open_corpus, tokenizer_spec
from shard.data.packing import PackedSource, packed_batch
from shard.data.sources import SYNTHETIC, TokenParts
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
    """The training samples: an infinite, seeded sequence of rows of seq_len + 1 tokens (windows, or
    packed rows of whole documents: shard.data.packing).

    grain orders them (a fresh shuffle of the source's rows every epoch); the source reads a whole
    block of rows with one vectorized gather. (Reading row by row through grain's MapDataset costs
    ~75 us a row in its per-element bookkeeping: 1.2 ms of host time per 16-row batch.)
    """

    loss_masked = False  # its batches carry a `loss_mask` (fine-tuning: shard.data.finetune)

    def __init__(self, source, order, seq_len: int | None = None, *, files: int | None = None,
                 documents: int | None = None):  # order: a grain.MapDataset of row indices, or None
        self.source, self.order = source, order  # order None: the source's own order (synthetic)
        self.seq_len = seq_len if seq_len is not None else getattr(source, "seq_len", None)
        self.files, self.documents = files, documents  # what was read, where known

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
        return self.source.read(self._indices(samples))

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


def sample_dataset(path: str, vocab_size: int, seq_len: int, seed: int, *, holdout: float = 0.0,
                   part: str = "all", data=None, cache_dir=None):
    """An infinite, seeded, random-access dataset of (seq_len + 1)-token rows.

    With `holdout`, the source splits in two: `part="train"` reads all but the last `holdout` share
    of it, `part="eval"` only that (held out: training never sees it); synthetic data has no split (each
    seed gives fresh tokens). `data` (a DataConfig) says how to read it: the tokenizer, the text
    field, the packing. A mixture file gives a MixtureSamples of its sources, each split alike."""
    from shard.config.train import DataConfig
    from shard.data.mixture import MixtureSamples, is_mixture, read_mixture

    data = data or DataConfig()
    if path == SYNTHETIC:
        if data.packing == "packed":
            raise ShardError("data.packing=packed needs documents, and synthetic data has none; use packing=concat")
        return Samples(SyntheticSource(vocab_size, seq_len, seed), None)
    # one tokenizer for all of it: a mixture's sources are read (or checked) with the first store's
    data = dataclasses.replace(data, tokenizer=tokenizer_spec(path, data.tokenizer))
    if is_mixture(path):
        entries = read_mixture(path)
        parts, caps = [], []
        for n, e in enumerate(entries):
            try:
                samples = sample_dataset(e.path, vocab_size, seq_len, (seed + 7919 * (n + 1)) % 2**32,
                                         holdout=holdout, part=part, data=data, cache_dir=cache_dir)
            except ShardError as err:
                raise ShardError(f"mixture {path}, source {n + 1}: {err}") from None
            parts.append(samples)
            capped = e.epochs and samples.windows is not None and part != "eval"  # held-out data: never spent
            caps.append(max(1, round(e.epochs * samples.windows)) if capped else None)
        return MixtureSamples(parts, [e.weight for e in entries], caps, seed, [e.path or "(embedded)" for e in entries])
    packed = data.packing == "packed"
    corpus = open_corpus(path, vocab_size=vocab_size, tokenizer=data.tokenizer, text_field=data.text_field,
                         packing=data.packing, cache_dir=cache_dir)
    if holdout and part != "all":
        corpus = corpus.split(holdout, seq_len, packed)[part == "eval"]
    if packed:
        from shard.data.packing import pack

        plan = pack(corpus.document_ends, seq_len)
        if not plan.rows:
            raise ShardError(f"data {corpus.label} holds no document of 2 tokens or more: nothing to pack")
        return _shuffled(PackedSource(corpus.tokens, plan), seed, seq_len, corpus)
    return _shuffled(WindowSource(corpus.tokens, seq_len), seed, seq_len, corpus)


def _shuffled(source, seed: int, seq_len: int, corpus=None) -> Samples:
    import grain  # here, not at the top: synthetic data never needs it

    ends = getattr(corpus, "document_ends", None)
    return Samples(source, grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(), seq_len,
                   files=getattr(corpus, "files", None), documents=None if ends is None else len(ends))


def data_summary(cfg, samples) -> str:
    """The start-up summary's line on the data: what is read, with which tokenizer, how it is packed,
    and a mixture's sources with their shares and sizes."""
    from shard.data.corpus import tokenizer_spec
    from shard.data.mixture import MixtureSamples
    from shard.data.tokenizers import describe, load_tokenizer

    path = cfg.data.path
    if path == SYNTHETIC:
        return f"data synthetic (uniform random tokens over {cfg.model.vocab_size:,} ids)"
    line = f"data {path or 'the embedded corpus'}"
    line += f" · tokenizer {describe(load_tokenizer(tokenizer_spec(path, cfg.data.tokenizer)))}"
    line += f" · model vocab {cfg.model.vocab_size:,}"
    if isinstance(samples, MixtureSamples):
        parts = [f"{label} {share:.1%} ({part.describe()})"
                 for label, share, part in zip(samples.labels, samples.shares(), samples.parts)]
        return line + f" · {cfg.data.packing} · mixture: " + "; ".join(parts)
    return line + f" · {samples.describe()}"


def repetition_note(samples, global_batch: int, seq_len: int) -> str | None:
    """A line when the data holds fewer distinct rows than one global batch, else None."""
    n = samples.windows
    if n is None or n >= global_batch:
        return None
    what = "packed row(s)" if getattr(samples, "packed", False) else "window(s)"
    return (f"the training data holds {n} {what} of {seq_len + 1} tokens, fewer than one global batch of "
            f"{global_batch}: every batch repeats them")


def held_out_share(cfg) -> float:
    """The share of data.path's windows a TrainConfig keeps from training (for evaluation), 0 for none
    (synthetic data holds nothing out: evaluation draws fresh tokens)."""
    return cfg.eval.holdout if cfg.eval.every and not cfg.eval.path and cfg.data.path != SYNTHETIC else 0.0


def training_samples(cfg):
    """The training data of a TrainConfig: data.path, less the held-out tail when evaluation takes it;
    a fine-tuning task's conversations or preference pairs (shard.data.finetune)."""
    if cfg.task != "pretrain":
        from shard.data.finetune import task_samples

        return task_samples(cfg)
    return sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed,
                          holdout=held_out_share(cfg), part="train", data=cfg.data, cache_dir=data_cache_dir(cfg))


def eval_samples(cfg):
    """The held-out data of a TrainConfig: eval.path, or data.path's held-out tail."""
    seed = (cfg.seed + 1) % 2**32  # another order than training's, within grain's seed range
    if cfg.eval.path:  # read with the training data's tokenizer
        data = dataclasses.replace(cfg.data, tokenizer=tokenizer_spec(cfg.data.path, cfg.data.tokenizer))
        try:
            return sample_dataset(cfg.eval.path, cfg.model.vocab_size, cfg.data.seq_len, seed, data=data,
                                  cache_dir=data_cache_dir(cfg))
        except ShardError as e:  # said as the held-out data's, not the training data's
            raise ShardError(f"eval.path: {e}") from None
    return sample_dataset(cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len, seed,
                          holdout=cfg.eval.holdout, part="eval", data=cfg.data, cache_dir=data_cache_dir(cfg))


def split_window(windows) -> dict[str, np.ndarray]:
    """(rows, T+1) windows -> next-token inputs, targets and a loss mask (0 where padded); packed rows
    (a dict) -> the same, plus segment ids and positions (shard.data.packing.packed_batch); rows with
    trained flags (fine-tuning: shard.data.finetune) -> also a `loss_mask`, 1 where the target is trained."""
    if isinstance(windows, dict) and "trained" in windows:
        batch = packed_batch(windows) if "segments" in windows else split_window(windows["tokens"])
        return batch | {"loss_mask": (windows["trained"][:, 1:] > 0).astype(np.float32)}
    if isinstance(windows, dict):
        return packed_batch(windows)
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
    filled_tokens: int = 0  # input tokens (not padding) of the batches made so far: tokens/s counts these
    made: int = 0  # batches made so far

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

        keys = ("inputs", "targets", "mask") + (("segment_ids", "positions") if self.packed else ())
        keys += ("loss_mask",) if getattr(self.dataset, "loss_masked", False) else ()
        batch = {k: make(k) for k in keys}
        if self.packed:  # every process counts the whole global batch's tokens (each holds the plan)
            self.filled_tokens += self.dataset.filled(self.position, self.position + self.global_batch)
        else:
            self.filled_tokens += self.global_batch * self.seq_len
        self.position += self.global_batch
        self.made += 1
        return batch

    @property
    def packed(self) -> bool:
        return getattr(self.dataset, "packed", False)
