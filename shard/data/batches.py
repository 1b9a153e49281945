"""The samples a run reads, and the global batch.

Each sample is a row of seq_len + 1 tokens (shard.data.samples): a window of the token stream
(data.packing = "concat"), or whole documents packed with their segment ids and positions ("packed",
shard.data.packing); a mixture draws rows from several sources (shard.data.mixture). grain shuffles the
rows from a seed and reshuffles every epoch. The stream's position is a global sample index: step k
reads samples [k*B, (k+1)*B), and each process materialises only the rows its devices hold. So the
stream is the same on any mesh or process count.
"""

from dataclasses import dataclass

import jax
import numpy as np

from shard.config.train import DataConfig
from shard.data.corpus import data_cache_dir, open_corpus
from shard.data.finetune import task_samples
from shard.data.mixture import MixtureSamples
from shard.data.packing import PackedSource, pack, packed_batch
from shard.data.samples import Samples, SyntheticSource, WindowSource
from shard.data.sources import MIXTURE, SYNTHETIC, DataSource, data_source, describe_data
from shard.data.tokenizers import BYTE, describe, load_tokenizer
from shard.errors import ShardError


def sample_dataset(path: str, vocab_size: int, seq_len: int, seed: int, *, holdout: float = 0.0,
                   part: str = "all", data=None, cache_dir=None):
    """An infinite, seeded, random-access dataset of (seq_len + 1)-token rows from the data at `path`;
    `data` (a DataConfig) says how to read it: the tokenizer, the text field, the packing. See
    `source_samples`."""
    data = data or DataConfig()
    source = describe_data(path, tokenizer=data.tokenizer, text_field=data.text_field, packing=data.packing)
    return source_samples(source, vocab_size, seq_len, seed, holdout=holdout, part=part, cache_dir=cache_dir)


def source_samples(source: DataSource, vocab_size: int, seq_len: int, seed: int, *, holdout: float = 0.0,
                   part: str = "all", cache_dir=None):
    """An infinite, seeded, random-access dataset of (seq_len + 1)-token rows from described data.

    With `holdout`, the source splits in two: `part="train"` reads all but the last `holdout` share
    of it, `part="eval"` only that (held out: training never sees it); synthetic data has no split (each
    seed gives fresh tokens). A mixture gives a MixtureSamples of its sources, each split alike."""
    if source.kind == SYNTHETIC:
        if source.packing == "packed":
            raise ShardError("data.packing=packed needs documents, and synthetic data has none; use packing=concat")
        return Samples(SyntheticSource(vocab_size, seq_len, seed), None, origin=source)
    if source.kind == MIXTURE:
        return _mixture_samples(source, vocab_size, seq_len, seed, holdout, part, cache_dir)
    packed = source.packing == "packed"
    corpus = open_corpus(source, vocab_size=vocab_size, cache_dir=cache_dir)
    if holdout and part != "all":
        corpus = corpus.split(holdout, seq_len, packed)[part == "eval"]
    if packed:
        plan = pack(corpus.document_ends, seq_len)
        if not plan.rows:
            raise ShardError(f"data {corpus.label} holds no document of 2 tokens or more: nothing to pack")
        return Samples.shuffled(PackedSource(corpus.tokens, plan), seed, seq_len, corpus, origin=source)
    return Samples.shuffled(WindowSource(corpus.tokens, seq_len), seed, seq_len, corpus, origin=source)


def _mixture_samples(source: DataSource, vocab_size: int, seq_len: int, seed: int, holdout: float, part: str,
                     cache_dir) -> MixtureSamples:
    """A mixture's sources' samples, each with a seed of its own, capped by their epochs."""
    samples, caps = [], []
    for n, mixed in enumerate(source.parts, 1):
        try:
            one = source_samples(mixed.source, vocab_size, seq_len, (seed + 7919 * n) % 2**32, holdout=holdout,
                                 part=part, cache_dir=cache_dir)
        except ShardError as err:
            raise ShardError(f"mixture {source.path}, source {n}: {err}") from None
        samples.append(one)
        capped = mixed.epochs and one.windows is not None and part != "eval"  # held-out data: never spent
        caps.append(max(1, round(mixed.epochs * one.windows)) if capped else None)
    return MixtureSamples(samples, [p.weight for p in source.parts], caps, seed,
                          [p.source.path or "(embedded)" for p in source.parts], origin=source)


def data_summary(cfg, samples) -> str:
    """The start-up summary's line on the data: what is read, with which tokenizer, how it is packed,
    and a mixture's sources with their shares and sizes."""
    path = cfg.data.path
    if path == SYNTHETIC:
        return f"data synthetic (uniform random tokens over {cfg.model.vocab_size:,} ids)"
    source = getattr(samples, "origin", None) or data_source(cfg)
    line = f"data {path or 'the embedded corpus'}"
    line += f" · tokenizer {describe(load_tokenizer(source.tokenizer))}"
    if source.tokenizer not in ("", BYTE):  # where it came from: --tokenizer, a store's, the weights'
        line += f" from {source.tokenizer}"
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


def training_samples(cfg, source: DataSource | None = None):
    """The training data of a TrainConfig: data.path, less the held-out tail when evaluation takes it;
    a fine-tuning task's conversations or preference pairs (shard.data.finetune). `source`: the data's
    description (shard.data.sources.data_source), where the caller has it."""
    source = source or data_source(cfg)
    if cfg.task != "pretrain":
        return task_samples(cfg, source)
    return source_samples(source, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed, holdout=held_out_share(cfg),
                          part="train", cache_dir=data_cache_dir(cfg))


def eval_samples(cfg, source: DataSource | None = None):
    """The held-out data of a TrainConfig: eval.path, or data.path's held-out tail. `source`: the
    training data's description, where the caller has it."""
    seed = (cfg.seed + 1) % 2**32  # another order than training's, within grain's seed range
    source = source or data_source(cfg)
    if cfg.eval.path:  # read with the training data's tokenizer
        try:
            held = describe_data(cfg.eval.path, tokenizer=source.tokenizer, text_field=cfg.data.text_field,
                                 packing=cfg.data.packing)
            return source_samples(held, cfg.model.vocab_size, cfg.data.seq_len, seed, cache_dir=data_cache_dir(cfg))
        except ShardError as e:  # said as the held-out data's, not the training data's
            raise ShardError(f"eval.path: {e}") from None
    return source_samples(source, cfg.model.vocab_size, cfg.data.seq_len, seed, holdout=cfg.eval.holdout,
                          part="eval", cache_dir=data_cache_dir(cfg))


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
