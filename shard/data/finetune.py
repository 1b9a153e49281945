"""The training samples of fine-tuning tasks (shard.data.chat reads the files):

- sft: conversations packed into rows as documents are in pre-training (shard.data.packing), with a
  row of trained flags beside the tokens; the batch's `loss_mask` is 1 where the target is an
  assistant token.
- dpo: one sequence per row, padded, the chosen and the rejected sequence of a pair in consecutive rows
  (sample 2k and 2k + 1); pairs are shuffled, never split.
"""

import numpy as np

from shard.data.chat import read_chats, read_pairs
from shard.data.corpus import check_tokenizer_fits
from shard.data.packing import PackedSource, pack
from shard.data.samples import Samples, shuffled_order
from shard.data.sources import DataSource, data_source
from shard.data.tokenizers import load_tokenizer
from shard.errors import ShardError


class ChatSource(PackedSource):
    """Packed conversations: `read(rows)` adds "trained" (1: an assistant token, 0: not, -1: padding)."""

    def __init__(self, tokens: np.ndarray, trained: np.ndarray, plan):
        super().__init__(tokens, plan)
        self.trained = PackedSource(trained.astype(np.int32), plan)

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return super().read(rows) | {"trained": self.trained.read(rows)["tokens"]}


class PairSource:
    """Preference pairs as padded rows of seq_len + 1 tokens: row 2k the chosen, 2k + 1 the rejected
    sequence of pair k; `read` gives tokens (-1: padding) and trained flags."""

    def __init__(self, pairs, seq_len: int):
        width = seq_len + 1
        self.seq_len, self.pairs = seq_len, len(pairs)
        self.rows = {k: np.full((2 * len(pairs), width), -1, np.int32) for k in ("tokens", "trained")}
        for k, (ci, cf, ri, rf) in enumerate(pairs):
            for j, (ids, flags) in enumerate(((ci, cf), (ri, rf))):
                n = min(width, len(ids))
                self.rows["tokens"][2 * k + j, :n] = ids[:n]
                self.rows["trained"][2 * k + j, :n] = flags[:n]
        self.tokens = self.rows["tokens"][self.rows["tokens"] >= 0]

    def __len__(self) -> int:
        return 2 * self.pairs

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        rows = np.asarray(rows, np.int64) % len(self)
        return {k: v[rows] for k, v in self.rows.items()}


class ChatSamples(Samples):
    loss_masked = True  # batches carry a loss_mask


class PairSamples(Samples):
    """Samples 2k and 2k + 1 are the two rows of the k-th pair in the shuffled order of pairs."""

    loss_masked = True

    def _indices(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, np.int64)
        pairs = np.fromiter((self.order[int(i)] for i in samples // 2), np.int64, len(samples))
        return 2 * pairs + samples % 2

    def describe(self) -> str:
        return f"{self.source.pairs:,} preference pairs ({self.tokens:,} tokens)"


def sft_samples(path: str, tokenizer, seq_len: int, seed: int, origin: DataSource | None = None) -> Samples:
    tokens, trained, ends = read_chats(path, tokenizer)
    plan = pack(ends, seq_len)
    return ChatSamples.shuffled(ChatSource(tokens, trained, plan), seed, seq_len, origin=origin)


def dpo_samples(path: str, tokenizer, seq_len: int, seed: int, origin: DataSource | None = None) -> Samples:
    pairs = read_pairs(path, tokenizer)
    for n, (_, cf, _, rf) in enumerate(pairs, 1):
        if not (cf[1:seq_len + 1].any() and rf[1:seq_len + 1].any()):
            raise ShardError(f"{path} pair {n}: its prompt fills the whole sequence of {seq_len + 1} tokens, so no "
                             "completion token is left to compare; raise --seq or shorten the prompt")
    return PairSamples(PairSource(pairs, seq_len), shuffled_order(len(pairs), seed), seq_len, origin=origin)


def task_samples(cfg, source: DataSource | None = None) -> Samples:
    """The training samples of a fine-tuning TrainConfig (task sft or dpo), read with data.tokenizer.
    `source`: the data's description, where the caller has it."""
    source = source or data_source(cfg)
    spec = source.tokenizer
    tokenizer = load_tokenizer(spec)
    check_tokenizer_fits(tokenizer, spec, cfg.model.vocab_size)
    read = sft_samples if cfg.task == "sft" else dpo_samples
    return read(cfg.data.path, tokenizer, cfg.data.seq_len, cfg.seed, origin=source)
