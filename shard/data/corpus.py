"""A described data path (shard.data.sources) opened for training: one token stream and, where the
source knows them, its documents' boundaries. What each kind of path becomes:

- a prepared token store (shard data prepare): read as it is, memory-mapped, after checking it was made
  with the run's tokenizer and fits the model's vocabulary;
- token arrays (.npy/.bin, or a folder of them): read as they are (no documents);
- text as bytes (the byte tokenizer on text files or the embedded corpus, concatenated windows): read
  directly, as bytes need no tokenizing;
- any other raw source (JSON Lines, Parquet, a saved dataset, a glob; text with another tokenizer or
  packed): prepared once into a store in the data cache (keyed by the sources and the tokenizer) and
  read from there next time.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.data.files import read_listed
from shard.data.sources import BYTES, STORE, SYNTHETIC, TOKENS, DataSource, data_source
from shard.data.store import cached_store
from shard.data.token_store import TokenStore
from shard.data.tokenizers import BYTE, load_tokenizer, padded_vocab
from shard.errors import ShardError


@dataclass
class Corpus:
    tokens: object  # 1-D: np.ndarray, np.memmap or shard.data.files.TokenParts
    document_ends: np.ndarray | None  # int64 end offset of each document; None: unknown (token arrays, bytes)
    label: str
    files: int | None = None  # the source files read (None: a token store, a saved dataset)

    def split(self, share: float, seq_len: int, packed: bool) -> tuple["Corpus", "Corpus"]:
        """(kept, held out): the last `share` of the corpus, cut on a document boundary when packed (at
        least one document each side), on a window boundary otherwise (at least one window each side)."""
        if not packed:
            windows = max(1, -(-(self.tokens.size - 1) // seq_len))
            held = max(1, round(windows * share))
            if held >= windows:
                raise ShardError(f"data {self.label} holds {windows} window(s) of {seq_len + 1} tokens: too few to "
                                 f"hold out eval.holdout={share:g} of them for evaluation; give eval.path, or more "
                                 "data, or a shorter --seq")
            cut = (windows - held) * seq_len
            return self._part(0, cut), self._part(cut, self.tokens.size)
        ends = self.document_ends
        if len(ends) < 2:
            raise ShardError(f"data {self.label} holds {len(ends)} document(s): too few to hold out "
                             f"eval.holdout={share:g} of them for evaluation; give eval.path, or more data")
        k = int(np.searchsorted(ends, (1 - share) * ends[-1]))  # the first document ending past the cut
        k = min(max(k, 0), len(ends) - 2)
        cut = int(ends[k])
        return self._part(0, cut), self._part(cut, int(ends[-1]))

    def _part(self, start: int, stop: int) -> "Corpus":
        ends = None
        if self.document_ends is not None:
            ends = self.document_ends[(self.document_ends > start) & (self.document_ends <= stop)] - start
        return Corpus(self.tokens[start:stop], ends, self.label, self.files)


def open_corpus(source: DataSource, *, vocab_size: int, cache_dir: Path | None) -> Corpus:
    """The token stream (and documents) of one described data path (not a mixture, not synthetic),
    checked against the model's vocabulary."""
    label = source.label
    if source.kind == TOKENS:
        if source.packing == "packed":
            raise ShardError(f"data.packing=packed needs document boundaries, and the token arrays of {label} have "
                             "none: prepare the text with `shard data prepare` (a token store) or use packing=concat")
        return Corpus(read_listed(source.listing, vocab_size), None, label, source.file_count)
    if source.kind == BYTES:
        return Corpus(read_listed(source.listing, vocab_size), None, label, source.file_count)
    spec = source.tokenizer
    tok = load_tokenizer(spec)
    check_tokenizer_fits(tok, spec, vocab_size)
    files = None
    if source.kind == STORE:
        store_path = Path(source.path)
    else:
        files = source.file_count
        if cache_dir is None:
            raise ShardError(f"data {label} must be prepared into a token store first, and data.cache is 'none': "
                             "run `shard data prepare` and give its --out as --data")
        store_path = cached_store(source, tok, cache_dir, source.text_field)
    store = TokenStore.open(store_path)
    store.check_tokenizer(tok)
    store.check_vocab(vocab_size)
    return Corpus(store.tokens, np.asarray(store.document_ends, np.int64), label, files)


def check_tokenizer_fits(tok, spec: str, vocab_size: int) -> None:
    if tok.vocab_size > vocab_size:
        raise ShardError(f"tokenizer {spec} has {tok.vocab_size:,} ids, more than model.vocab_size {vocab_size:,} (set "
                         "by the config, a resumed run or the weights it starts from): use the model's own "
                         f"tokenizer, or a vocabulary of at least {tok.vocab_size:,}")


def fit_vocab(cfg, vocab_set: bool, source: DataSource | None = None):
    """(cfg, a note or None): the model's vocabulary follows the data's tokenizer unless `vocab_set` (by
    the user, a resumed run or the weights it starts from): the tokenizer's size padded up to a multiple
    of 128. A set vocabulary smaller than the tokenizer's is an error naming both. `source`: the data's
    description, where the caller has it."""
    source = source or data_source(cfg)
    if source.kind == SYNTHETIC:
        return cfg, None
    spec = source.tokenizer
    if spec == BYTE:
        return cfg, None
    tok = load_tokenizer(spec)
    if vocab_set:
        check_tokenizer_fits(tok, spec, cfg.model.vocab_size)
        return cfg, None
    vocab = padded_vocab(tok.vocab_size)
    note = None if vocab == cfg.model.vocab_size else \
        f"model.vocab_size {vocab:,}: the tokenizer's {tok.vocab_size:,} ids, padded up to a multiple of 128"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab)), note


def data_cache_dir(cfg) -> Path | None:
    """Where raw sources given to `shard train` are prepared: data.cache, or with "auto" a folder beside
    the run dirs (as the compile cache); None when data.cache is "none"."""
    if cfg.data.cache in ("", "none"):
        return None
    if cfg.data.cache != "auto":
        return Path(cfg.data.cache)
    runs = Path(cfg.run_dir).parent if cfg.run_dir else Path("runs")
    return runs.absolute() / ".data_cache"
