"""Tokenizers: text to token ids and back. One small protocol, `Tokenizer`, with three implementations:
UTF-8 bytes (`byte`, no file), a Hugging Face tokenizer (`tokenizer.json`, through the `tokenizers`
library) and a SentencePiece model (`.model`, through `sentencepiece`). `load_tokenizer(spec)` reads
any of them; `Tokenizer.save(folder)` writes the files `load_tokenizer(folder)` reads back, byte for
byte, so a run, a checkpoint and a token store carry the tokenizer they were made with.

A document's ids are `document_ids`: the tokenizer's BOS first where it uses one, its EOS last where it
has one, so document boundaries are known downstream (packing, evaluation)."""

import hashlib
import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from shard.errors import ShardError

BYTE_VOCAB = 256
BYTE = "byte"
HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
SP_FILE = "tokenizer.model"
BYTE_FILE = "shard_tokenizer.json"  # the byte tokenizer's marker in a saved folder (it has no file of its own)
# Names tokenizers give their special tokens, in order of preference, when tokenizer_config.json does not say.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
# A lone UTF-16 surrogate: JSON can escape one ("\\ud800") and Python keeps a byte that is not UTF-8 in a
# command-line argument as one (U+DC80..U+DCFF), but it is no Unicode character: no tokenizer encodes it.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Vocabularies above this are refused before the `tokenizers` library sizes its tables by them (it aborts the
# process past about 2**31; 2**24 already takes 0.5 GB and seconds): 4x the largest released (Gemma's 262,144).
MAX_BPE_VOCAB = 1 << 20
# A long text is encoded a piece at a time, cut where the ids stay those of the whole (`encode_in_pieces`):
# encoding holds ~100 bytes a character, so one 50 MB line took 6 GB whole.
PIECE_CHARS = 1 << 20
MAX_PIECE_CHARS = 8 * PIECE_CHARS  # a text with no place to cut it in this many characters is refused
_CUT_WINDOW = 1024  # characters each side of a cut that must encode to the same ids cut and whole
_CUT_TRIES = 32  # places tried for one cut before the text is refused
_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")  # a space or line end between two words: where every tokenizer splits


@runtime_checkable
class Tokenizer(Protocol):
    """What shard needs of a tokenizer."""

    kind: str  # "byte" | "huggingface" | "sentencepiece"
    vocab_size: int  # ids are 0..vocab_size-1, special tokens included
    bos_id: int | None
    eos_id: int | None
    eos_guessed: str  # where no config named eos_id: the token and where it was found ("" otherwise)
    pad_id: int | None
    add_bos: bool  # documents start with bos_id (the tokenizer's own convention)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...

    @property
    def special_tokens(self) -> dict[str, int]: ...

    @property
    def fingerprint(self) -> str: ...

    def save(self, folder: Path) -> None: ...


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """One text's ids, without BOS or EOS (a prompt, a continuation)."""
    return tokenizer.encode_batch([text])[0]


def lone_surrogate(text: str, argv: bool = False) -> str:
    """What makes `text` no Unicode text ("" when nothing does): its first lone surrogate, named with where
    it is; `argv`: the text came from the command line, where such a character stands for a byte that is
    not UTF-8."""
    found = None if text.isascii() else _SURROGATE.search(text)  # isascii: a flag, no scan
    if found is None:
        return ""
    code = ord(found.group())
    if argv and 0xDC80 <= code <= 0xDCFF:
        return f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8 (at character {found.start()})"
    return f"a lone UTF-16 surrogate \\u{code:04x}, which is no Unicode character (at character {found.start()})"


def encode_in_pieces(encode, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids by `encode` (a tokenizer's own batch encoding, list of texts to list of id arrays),
    with memory bounded whatever the texts' lengths: a text longer than PIECE_CHARS is cut into pieces of
    about that many characters, each cut at a space or line end between two words where the `_CUT_WINDOW`
    characters each side encode to the same ids cut as whole (so the pieces' ids are the text's), and the
    pieces are encoded a batch of at most PIECE_CHARS characters at a time. A text that has no such place in
    MAX_PIECE_CHARS characters is refused (a ShardError)."""
    out: list[list[np.ndarray]] = [[] for _ in texts]
    batch, owners, size = [], [], 0
    for i, text in enumerate(texts):
        cuts = _cuts(encode, text)
        for a, b in zip(cuts, cuts[1:]):
            if batch and size + b - a > PIECE_CHARS:
                for owner, ids in zip(owners, encode(batch)):
                    out[owner].append(ids)
                batch, owners, size = [], [], 0
            batch.append(text[a:b])
            owners.append(i)
            size += b - a
    for owner, ids in zip(owners, encode(batch) if batch else []):
        out[owner].append(ids)
    return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in out]  # a text: 1 piece or more


def _cuts(encode, text: str) -> list[int]:
    """Where `text` is cut into pieces (`encode_in_pieces`): 0, the cuts, len(text)."""
    cuts = [0]
    while len(text) - cuts[-1] > PIECE_CHARS:
        cut = _cut(encode, text, cuts[-1])
        if cut is None:
            if len(text) - cuts[-1] > MAX_PIECE_CHARS:
                raise ShardError(f"a text of {len(text):,} characters has no place to cut it between characters "
                                 f"{cuts[-1] + PIECE_CHARS:,} and {cuts[-1] + MAX_PIECE_CHARS:,} (a space or line end "
                                 "between words where its tokens stay the same): texts are tokenized in pieces, so "
                                 "that one long line can't take gigabytes; split it")
            break
        cuts.append(cut)
    return cuts + [len(text)]


def _cut(encode, text: str, at: int) -> int | None:
    """The first of `_CUT_TRIES` places (a space or line end between words) from at + PIECE_CHARS on whose
    `_CUT_WINDOW` characters each side encode to the same ids cut and whole; None if none is."""
    found = _CUT.finditer(text, at + PIECE_CHARS, min(len(text), at + MAX_PIECE_CHARS))
    for place in itertools.islice(found, _CUT_TRIES):
        c = place.start()
        left, right = text[max(at, c - _CUT_WINDOW):c], text[c:c + _CUT_WINDOW]
        whole, a, b = encode([left + right, left, right])
        if np.array_equal(whole, np.concatenate([a, b])):
            return c
    return None


def document_ids(tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """A document's ids with the tokenizer's BOS (where it uses one) and EOS (where it has one)."""
    parts = [ids]
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        parts.insert(0, np.array([tokenizer.bos_id], ids.dtype))
    if tokenizer.eos_id is not None:
        parts.append(np.array([tokenizer.eos_id], ids.dtype))
    return np.concatenate(parts) if len(parts) > 1 else ids


def describe(tokenizer: Tokenizer) -> str:
    """`huggingface (8,000 ids, eos 0)` for start-up summaries; an end-of-text token that no config named
    is named, with where it came from, and a tokenizer with files but none says `no eos` (its documents
    run together)."""
    marks = [f"{tokenizer.vocab_size:,} ids"]
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        marks.append(f"bos {tokenizer.bos_id}")
    if tokenizer.eos_id is not None:
        marks.append(f"eos {tokenizer.eos_id}" + (f" {tokenizer.eos_guessed}" if tokenizer.eos_guessed else ""))
    elif tokenizer.kind != BYTE:
        marks.append("no eos")
    return f"{tokenizer.kind} ({', '.join(marks)})"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: no vocabulary file, works on any text, no special tokens."""

    kind = BYTE
    vocab_size = BYTE_VOCAB
    bos_id = eos_id = pad_id = None
    eos_guessed = ""
    add_bos = False
    special_tokens: dict[str, int] = {}
    fingerprint = BYTE

    def encode(self, text: str) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise ShardError(f"a text holds {lone_surrogate(text)}") from None
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / BYTE_FILE).write_text(json.dumps({"kind": BYTE}) + "\n")


class HuggingFaceTokenizer:
    """A `tokenizer.json` (any model the `tokenizers` library reads: BPE, WordPiece, Unigram), with the
    special tokens its `tokenizer_config.json` names beside it; those it does not name (or all, with no
    config) are the first of the usual names (`<|endoftext|>`, `</s>` ...) among its special tokens."""

    kind = "huggingface"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as RustTokenizer  # here: byte-level runs and `import shard` need none

        self.path = path
        self.config_path = path.with_name(HF_CONFIG)
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a bad file
            raise ShardError(f"{path} is not a Hugging Face tokenizer ({str(e).splitlines()[0][:160]})") from None
        config = read_json_object(self.config_path) if self.config_path.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.eos_guessed = self._special_id(config, "eos_token", _EOS_NAMES)
        self.pad_id, _ = self._special_id(config, "pad_token", _PAD_NAMES)
        self.bos_id, _ = self._special_id(config, "bos_token", _BOS_NAMES)
        # whether documents start with BOS: what the config says, else what the post-processor does
        added = self._tok.encode("a").ids
        bare = self._tok.encode("a", add_special_tokens=False).ids
        uses = bool(added) and len(added) > len(bare) and added[0] == self.bos_id
        self.add_bos = bool(config.get("add_bos_token", uses)) and self.bos_id is not None

    def _special_id(self, config: dict, key: str, usual: tuple[str, ...]) -> tuple[int | None, str]:
        """The id of the token `config[key]` names; where the config names none, the first of the `usual`
        names among the special tokens, and a note saying so (the token and where it came from; "" when
        the config named it). A name that is no token of the vocabulary is an error, not a silent None."""
        named = config.get(key)
        if isinstance(named, dict):  # an AddedToken written out: {"content": "</s>", ...}
            named = named.get("content")
        if named is None:
            special = self.special_tokens
            found = next((name for name in usual if name in special), None)
            if found is None:
                return None, ""
            where = f"{HF_CONFIG} names none" if self.config_path.is_file() else f"no {HF_CONFIG}"
            return special[found], f"{found} ({where}: taken from its special tokens)"
        if not isinstance(named, str):
            raise ShardError(f"{self.config_path}: {key} must be a token (a string), not "
                             f"{json.dumps(config[key])[:80]}")
        token_id = self._tok.token_to_id(named)
        if token_id is None:
            raise ShardError(f"{self.config_path}: {key} {json.dumps(named)[:80]} is no token of {self.path}")
        return token_id, ""

    def transformers_config(self) -> dict:
        """Its tokenizer_config.json with what transformers' AutoTokenizer needs added where missing: a
        class to load it with and the special tokens shard reads it with, so that a model exported with
        it (lm-eval's `hf` backend, generate) ends documents where shard's training data did. The
        config's other keys (a chat template ...) are kept as they are."""
        config = read_json_object(self.config_path) if self.config_path.is_file() else {}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for key, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)):
            if config.get(key) is None and token_id is not None:
                config[key] = self._tok.id_to_token(token_id)
        return config

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return encode_in_pieces(self._encode, texts)

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips the offsets (tokenizers >= 0.20), which shard never reads
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        try:
            return [np.asarray(e.ids, np.int32) for e in encode(texts, add_special_tokens=False)]
        except TypeError:  # the library takes no text with a lone surrogate: say which
            problem = next((p for p in map(lone_surrogate, texts) if p), None)
            if problem is None:
                raise
            raise ShardError(f"a text holds {problem}") from None

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        return _digest([self.path] + ([self.config_path] if self.config_path.is_file() else []))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for f in (self.path, self.config_path, self.path.with_name("special_tokens_map.json")):
            if f.is_file() and f.resolve() != (folder / f.name).resolve():
                shutil.copyfile(f, folder / (HF_FILE if f == self.path else f.name))


class SentencePieceTokenizer:
    """A SentencePiece `.model` (Llama 2, Gemma, T5 ...)."""

    kind = "sentencepiece"

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError:
            raise ShardError(f"{path} is a SentencePiece model; reading it needs sentencepiece "
                             "(./install.sh data)") from None
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ShardError(f"{path} is not a SentencePiece model ({str(e).splitlines()[0][:160]})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id, self.eos_id, self.pad_id = (i if i >= 0 else None for i in
                                                 (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()))
        self.add_bos = self.bos_id is not None  # SentencePiece models (Llama, Gemma) start documents with BOS
        self.eos_guessed = ""  # the model names its own

    @property
    def special_tokens(self) -> dict[str, int]:
        return {self._sp.IdToPiece(i): i for i in range(self.vocab_size)
                if self._sp.IsControl(i) or self._sp.IsUnknown(i)}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return encode_in_pieces(lambda batch: [np.asarray(ids, np.int32) for ids in self._sp.Encode(batch)], texts)

    def decode(self, ids) -> str:
        return self._sp.Decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        return _digest([self.path])

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.path.resolve() != (folder / SP_FILE).resolve():
            shutil.copyfile(self.path, folder / SP_FILE)


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, a `tokenizer.json`, a SentencePiece `.model`, or a folder holding one of them (a saved
    run's, a checkpoint's, a Hugging Face model's: tokenizer.json is preferred to tokenizer.model)."""
    if spec in ("", BYTE):
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        for name in (HF_FILE, SP_FILE, BYTE_FILE):
            if (path / name).is_file():
                return load_tokenizer(str(path / name))
        raise ShardError(f"tokenizer folder {path} holds no {HF_FILE}, {SP_FILE} or {BYTE_FILE}")
    if not path.exists():
        raise ShardError(f"tokenizer {spec} does not exist (give 'byte', a tokenizer.json, a SentencePiece "
                         ".model or a folder with one)")
    if path.name == BYTE_FILE:
        if read_json_object(path).get("kind") != BYTE:
            raise ShardError(f"{path} does not describe a shard tokenizer")
        return ByteTokenizer()
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    return HuggingFaceTokenizer(path)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; one line naming the file otherwise."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ShardError(f"{path} is not a JSON object")
    return doc


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes() + b"\0")  # contents alone: a copy under another name is the same tokenizer
    return h.hexdigest()[:16]


def padded_vocab(tokenizer_vocab: int, multiple: int = 128) -> int:
    """The model's vocabulary for a tokenizer's: rounded up to a multiple of 128 (matmul-friendly tiles
    and an even split over the mesh)."""
    return -(-tokenizer_vocab // multiple) * multiple


def train_bpe(texts, vocab_size: int, out: Path, *, length: int | None = None,
              eos: str = "<|endoftext|>") -> HuggingFaceTokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on an iterator of texts with the `tokenizers`
    library, written to `out` as tokenizer.json and the tokenizer_config.json that lets transformers'
    AutoTokenizer load it. `eos` is its one special token (id 0), appended to every document."""
    from tokenizers import Tokenizer as RustTokenizer  # here, as in HuggingFaceTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < BYTE_VOCAB + 1:
        raise ShardError(f"--vocab-size {vocab_size} is too small: a byte-level BPE holds the 256 bytes and "
                         "an end-of-text token at least")
    if vocab_size > MAX_BPE_VOCAB:
        raise ShardError(f"--vocab-size {vocab_size:,} is too large: at most {MAX_BPE_VOCAB:,} ids (four times the "
                         "largest released vocabulary)")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_pieces(texts), trainer, length=length)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / HF_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None,
              "pad_token": None, "unk_token": None, "add_bos_token": False, "model_max_length": 1 << 30,
              "clean_up_tokenization_spaces": False}
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return HuggingFaceTokenizer(out / HF_FILE)


def _training_pieces(texts):
    """The texts, each longer than PIECE_CHARS cut into pieces of about that many characters at a space or
    line end between words (past MAX_PIECE_CHARS without one, anywhere): the trainer counts a text's words
    all at once (one 50 MB line took 4.4 GB), and such a cut leaves the words it counts as they were."""
    for text in texts:
        at = 0
        while len(text) - at > PIECE_CHARS:
            place = _CUT.search(text, at + PIECE_CHARS, at + MAX_PIECE_CHARS)
            cut = place.start() if place else at + PIECE_CHARS
            yield text[at:cut]
            at = cut
        yield text[at:] if at else text
