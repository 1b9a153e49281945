"""A data path opened for training: one token stream and, where the source knows them, its documents'
boundaries. What each kind of path becomes:

- a prepared token store (shard data prepare): read as it is, memory-mapped, after checking it was made
  with the run's tokenizer and fits the model's vocabulary;
- token arrays (.npy/.bin, or a folder of them): read as they are (no documents);
- text as bytes (the byte tokenizer on text files or the embedded corpus, concatenated windows): read
  directly, as bytes need no tokenizing;
- any other raw source (JSON Lines, Parquet, a saved dataset, a glob; text with another tokenizer or
  packed): prepared once into a store in the data cache (keyed by the sources and the tokenizer) and
  read from there next time.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.data.sources import EMBEDDED, SYNTHETIC, is_glob, load_tokens, source_files
from shard.data.tokenizers import BYTE, load_tokenizer
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR

# Suffixes whose files hold documents in a format of their own (not plain text).
DOCUMENT_SUFFIXES = (".jsonl", ".parquet", ".arrow")


@dataclass
class Corpus:
    tokens: object  # 1-D: np.ndarray, np.memmap or shard.data.sources.TokenParts
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


def is_token_source(path: str) -> bool:
    """Token arrays (.npy/.bin, or a folder or glob of them): read as they are."""
    if path in (EMBEDDED, SYNTHETIC) or _is_store(path) or _is_dataset_folder(Path(path)):
        return False
    if not Path(path).exists() and not is_glob(path):
        return False
    try:
        return source_files(path)[1]
    except ShardError:
        return False


def reads_as_bytes(path: str, tokenizer: str, packing: str) -> bool:
    """Text read directly as UTF-8 bytes: the byte tokenizer on text files (or the embedded corpus) in
    concatenated windows, today's fast path, with nothing to prepare."""
    if tokenizer not in ("", BYTE) or packing != "concat" or path == SYNTHETIC:
        return False
    if path == EMBEDDED:
        return True
    p = Path(path)
    if not p.exists() or _is_store(path) or _is_dataset_folder(p):
        return False
    files, tokens = source_files(path)
    return not tokens and not any(f.suffix in DOCUMENT_SUFFIXES for f in files)


def _is_store(path: str) -> bool:
    from shard.data.store import is_store

    return path not in (EMBEDDED, SYNTHETIC) and is_store(path)


def _is_dataset_folder(p: Path) -> bool:
    from shard.data.documents import is_dataset_folder

    return is_dataset_folder(p)


def tokenizer_spec(data_path: str, tokenizer: str) -> str:
    """The one tokenizer a run reads all its data with (every source of a mixture, the held-out data):
    data.tokenizer when given, else a store's own (the first store of a mixture: the others must have
    been made with the same one), else bytes."""
    if tokenizer:
        return tokenizer
    from shard.data.mixture import is_mixture, read_mixture

    paths = [e.path for e in read_mixture(data_path)] if is_mixture(data_path) else [data_path]
    for p in paths:
        if _is_store(p):
            return str(Path(p) / TOKENIZER_DIR)
    return BYTE


def open_corpus(path: str, *, vocab_size: int, tokenizer: str, text_field: str, packing: str,
                cache_dir: Path | None) -> Corpus:
    """The token stream (and documents) of one data path, checked against the model's vocabulary."""
    label = "the embedded corpus" if path == EMBEDDED else str(path)
    if is_token_source(path):
        if packing == "packed":
            raise ShardError(f"data.packing=packed needs document boundaries, and the token arrays of {label} have "
                             "none: prepare the text with `shard data prepare` (a token store) or use packing=concat")
        return Corpus(load_tokens(path, vocab_size), None, label, _file_count(path))
    if reads_as_bytes(path, tokenizer, packing):
        return Corpus(load_tokens(path, vocab_size), None, label, _file_count(path))
    from shard.data.store import TokenStore, cached_store, is_store

    spec = tokenizer_spec(path, tokenizer)
    tok = load_tokenizer(spec)
    check_tokenizer_fits(tok, spec, vocab_size)
    files = None
    if is_store(path):
        store_path = Path(path)
    else:
        files = _file_count(path)
        if cache_dir is None:
            raise ShardError(f"data {label} must be prepared into a token store first, and data.cache is 'none': "
                             "run `shard data prepare` and give its --out as --data")
        store_path = cached_store([path], tok, cache_dir, text_field)
    store = TokenStore.open(store_path)
    store.check_tokenizer(tok)
    store.check_vocab(vocab_size)
    return Corpus(store.tokens, np.asarray(store.document_ends, np.int64), label, files)


def _file_count(path: str) -> int | None:
    """How many files a data path reads (None: a saved dataset, whose files are not the user's)."""
    if path != EMBEDDED and _is_dataset_folder(Path(path)):
        return None
    try:
        return len(source_files(path)[0])
    except ShardError:
        return None


def check_tokenizer_fits(tok, spec: str, vocab_size: int) -> None:
    if tok.vocab_size > vocab_size:
        raise ShardError(f"tokenizer {spec} has {tok.vocab_size:,} ids, more than model.vocab_size {vocab_size:,} (set "
                         "by the config, a resumed run or the weights it starts from): use the model's own "
                         f"tokenizer, or a vocabulary of at least {tok.vocab_size:,}")


def fit_vocab(cfg, vocab_set: bool):
    """(cfg, a note or None): the model's vocabulary follows the data's tokenizer unless `vocab_set` (by
    the user, a resumed run or the weights it starts from): the tokenizer's size padded up to a multiple
    of 128. A set vocabulary smaller than the tokenizer's is an error naming both."""
    import dataclasses

    from shard.data.tokenizers import padded_vocab

    if cfg.data.path == SYNTHETIC:
        return cfg, None
    spec = tokenizer_spec(cfg.data.path, cfg.data.tokenizer)
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
