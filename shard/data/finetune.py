"""The training samples of fine-tuning tasks (shard.data.chat reads the files):

- sft: conversations packed into rows as documents are in pre-training (shard.data.packing), with a
  row of trained flags beside the tokens; the batch's `loss_mask` is 1 where the target is an
  assistant token.
- dpo: one sequence per row, padded, the chosen and the rejected sequence of a pair in consecutive rows
  (sample 2k and 2k + 1); pairs are shuffled, never split. A pair longer than a row has its prompt cut
  from the left (dpo.max_prompt_tokens), or is left out (fit_pairs).
- grpo: prompts (shard.data.chat.read_prompts), each step's drawn by a PromptStream; the rows are built
  from the completions sampled (shard.training.rollouts).
"""

from dataclasses import dataclass

import numpy as np

from shard.data.chat import Prompt, read_chats, read_pairs, read_prompts
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

    def __init__(self, pairs, seq_len: int, note: str = ""):
        width = seq_len + 1
        self.seq_len, self.pairs, self.note = seq_len, len(pairs), note  # note: what fitting them did
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
        note = f"; {self.source.note}" if self.source.note else ""
        return f"{self.source.pairs:,} preference pairs ({self.tokens:,} tokens{note})"


def sft_samples(path: str, tokenizer, seq_len: int, seed: int, origin: DataSource | None = None) -> Samples:
    tokens, trained, ends = read_chats(path, tokenizer)
    plan = pack(ends, seq_len)
    return ChatSamples.shuffled(ChatSource(tokens, trained, plan), seed, seq_len, origin=origin)


def dpo_samples(path: str, tokenizer, seq_len: int, seed: int, origin: DataSource | None = None,
                max_prompt_tokens: int = 0) -> Samples:
    """The pairs of `path` that fit rows of seq_len + 1 tokens (fit_pairs; `max_prompt_tokens` 0: half
    of seq_len); none fitting is an error."""
    pairs = read_pairs(path, tokenizer)
    keep = max_prompt_tokens or max(1, seq_len // 2)
    fitted, cut = fit_pairs(pairs, seq_len + 1, keep)
    if not fitted:
        raise ShardError(f"{path}: none of its {len(pairs):,} preference pairs fits --seq {seq_len}, even with its "
                         f"prompt cut to its last {keep} tokens (dpo.max_prompt_tokens); raise --seq")
    dropped = len(pairs) - len(fitted)
    note = ", ".join(([f"{cut:,} prompt(s) cut to their last {keep} tokens"] if cut else []) +
                     ([f"{dropped:,} pair(s) left out, longer than --seq {seq_len} even so"] if dropped else []))
    return PairSamples(PairSource(fitted, seq_len, note), shuffled_order(len(fitted), seed), seq_len, origin=origin)


def fit_pairs(pairs, width: int, max_prompt_tokens: int) -> tuple[list, int]:
    """(the pairs whose two sequences fit `width` tokens, how many of them had their prompt cut). A pair
    too long keeps only the last `max_prompt_tokens` tokens of its prompt (the tokens before its first
    trained one), as TRL's max_prompt_length; one still too long is left out, as is one with no
    completion token to compare (an empty answer). A pair that fits is kept whole."""
    def fits(ci, cf, ri, rf) -> bool:  # and a completion token to compare in each (a target: past index 0)
        return len(ci) <= width and len(ri) <= width and bool(cf[1:].any() and rf[1:].any())

    fitted, cut = [], 0
    for pair in pairs:
        if fits(*pair):
            fitted.append(pair)
            continue
        both = []
        for ids, flags in (pair[:2], pair[2:]):
            start = max(0, int(np.argmax(flags > 0)) - max_prompt_tokens)  # the prompt's first token kept
            both += [ids[start:], flags[start:]]
        if fits(*both):
            fitted.append(tuple(both))
            cut += 1
    return fitted, cut


def task_samples(cfg, source: DataSource | None = None) -> Samples:
    """The training samples of a fine-tuning TrainConfig (task sft or dpo), read with data.tokenizer.
    `source`: the data's description, where the caller has it."""
    source = source or data_source(cfg)
    spec = source.tokenizer
    tokenizer = load_tokenizer(spec)
    check_tokenizer_fits(tokenizer, spec, cfg.model.vocab_size)
    if cfg.task == "grpo":
        prompts = read_prompts(cfg.data.path, tokenizer, cfg.data.seq_len + 1 - cfg.grpo.max_new_tokens)
        return PromptSet(prompts, tokenizer, cfg.data.path, source)
    if cfg.task == "dpo":
        return dpo_samples(cfg.data.path, tokenizer, cfg.data.seq_len, cfg.seed, origin=source,
                           max_prompt_tokens=cfg.dpo.max_prompt_tokens)
    return sft_samples(cfg.data.path, tokenizer, cfg.data.seq_len, cfg.seed, origin=source)


@dataclass(frozen=True)
class PromptSet:
    """GRPO's prompts, with the tokenizer that rendered them (the rewards read its decoding)."""

    prompts: list[Prompt]
    tokenizer: object
    path: str
    origin: DataSource | None = None
    rewards: tuple = ()  # shard.training.rewards.Reward, loaded by the trainer before it compiles
    windows = None  # no fixed rows: shard.data.batches.repetition_note has nothing to say

    def describe(self) -> str:
        return f"{len(self.prompts):,} prompts"


@dataclass
class PromptStream:
    """The prompts of each GRPO step, `batch // group` of them (`batch` completions, `group` a prompt), in a
    fresh shuffle every epoch from the seed. `position` counts completions, as BatchStream's counts rows:
    a checkpoint keeps it, and a resumed run draws the same prompts. `next()`: (the step's index from 0,
    its prompts)."""

    dataset: PromptSet
    batch: int
    group: int
    seq_len: int
    seed: int
    position: int = 0
    filled_tokens: int = 0  # rows x seq_len, as the trainer reads them
    made: int = 0
    packed = False

    def next(self) -> tuple[int, list[Prompt]]:
        n, per_step = len(self.dataset.prompts), self.batch // self.group
        first = self.position // self.group
        orders = {e: self._order(e) for e in range(first // n, (first + per_step - 1) // n + 1)}  # once a step
        picked = [self.dataset.prompts[orders[k // n][k % n]] for k in range(first, first + per_step)]
        index = self.position // self.batch
        self.position += self.batch
        self.filled_tokens += self.batch * self.seq_len
        self.made += 1
        return index, picked

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.dataset.prompts))
