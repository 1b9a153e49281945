"""A token store as it stands on disk, opened and checked (what `shard data prepare` writes: shard.data.store).

    DIR/store.json           {"format": "shard-token-store", "version": 1, "dtype": "uint16" | "uint32",
                              "tokenizer": {"kind", "fingerprint", "vocab_size", "bos_id", "eos_id"},
                              "text_field", "sources", "key", "shards": [{"tokens", "documents", "n_tokens",
                              "n_documents", "max_token", "tokens_bytes", "documents_bytes", "tokens_crc32",
                              "documents_crc32"}], "n_tokens", "n_documents"}   (the last four of a shard:
                              stores written before them have none)
    DIR/tokens-00000.bin     a shard's token ids, raw little-endian dtype, its documents back to back
    DIR/documents-00000.npy  int64 end offset of each document in its shard (ascending; the last is n_tokens)
    DIR/plan.json            the chunk of the sources each shard was made from
    DIR/tokenizer/           the tokenizer's files (load_tokenizer reads the folder)

`TokenStore.open` trusts nothing in store.json: every field is checked for its type and range, the
shards must be files of the store's own folder, and the counts must match the files. It reads no
shard whole (a store of 10B tokens is 20 GB, opened at every start of a run), so the ids are checked
where a batch reads them (shard.data.samples.check_ids); `verify` reads every shard against its
checksums."""

import dataclasses
import zlib
from pathlib import Path

import numpy as np

from shard.data.files import STORE_FILE, TokenParts
from shard.data.files import STORE_FORMAT as FORMAT
from shard.data.tokenizers import Tokenizer, load_tokenizer, read_json_object
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR

VERSION = 1
DTYPES = ("uint16", "uint32")
READ_BYTES = 16 << 20  # what a checksum reads at a time


def tokens_name(i: int) -> str:
    return f"tokens-{i:05d}.bin"


def documents_name(i: int) -> str:
    return f"documents-{i:05d}.npy"


def crc_hex(value: int) -> str:
    return f"{value:08x}"


@dataclasses.dataclass
class TokenStore:
    """A token store, opened and checked: `tokens` is the whole stream (memory-mapped shards read as
    one 1-D array, whose ids are checked against the vocabulary as batches read them), `document_ends`
    the global end offset of every document."""

    path: Path
    meta: dict
    tokens: TokenParts
    document_ends: np.ndarray

    @classmethod
    def open(cls, path) -> "TokenStore":
        """The store at `path`, its store.json checked whole (each field's type and range, the shards'
        names, the totals) and its shards' sizes and document ends checked against it; no shard is read
        whole (`verify` does that)."""
        path = Path(path)
        if not (path / STORE_FILE).is_file():
            partial = path.with_name(path.name + ".partial")
            hint = f" ({partial} is an unfinished one: run the same prepare again)" if partial.exists() else ""
            raise ShardError(f"{path} is not a token store: it has no {STORE_FILE}{hint}")
        meta = read_json_object(path / STORE_FILE)
        dtype = _check_meta(path, meta)
        parts, ends, offset = [], [], 0
        for s in meta["shards"]:
            try:
                tokens = _open_shard(path, s, dtype)
                ends.append(_shard_ends(path, s) + offset)
            except ShardError as e:
                raise ShardError(f"token store {path}: {e}") from None
            parts.append(tokens)
            offset += tokens.size
        vocab = meta["tokenizer"]["vocab_size"]
        return cls(path, meta, TokenParts(parts, vocab=vocab, label=f"token store {path}"),
                   np.concatenate(ends).astype(np.int64))

    def verify(self) -> None:
        """Every shard read whole: its CRC-32s (where store.json records them; stores written before
        them have none) and its ids (the largest is the recorded max_token, inside the vocabulary). One
        line naming the store and the first damaged shard."""
        dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        for s in self.meta["shards"]:
            try:
                check_files(self.path, s, dtype)
            except ShardError as e:
                raise ShardError(f"token store {self.path}: {e}") from None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_documents(self) -> int:
        return int(self.document_ends.size)

    @property
    def max_token(self) -> int:
        return max(int(s["max_token"]) for s in self.meta["shards"])

    @property
    def tokenizer_info(self) -> dict:
        return dict(self.meta["tokenizer"])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(str(self.path / TOKENIZER_DIR))

    def check_tokenizer(self, tok: Tokenizer) -> None:
        """A store is read with the tokenizer it was made with, or not at all; its recorded vocabulary
        (what the ids of its batches are checked against) is that tokenizer's."""
        mine = self.tokenizer_info
        if (mine["kind"], mine["fingerprint"]) != (tok.kind, tok.fingerprint):
            raise ShardError(f"token store {self.path} was made with the {mine['kind']} tokenizer "
                             f"{mine['fingerprint']}, not the {tok.kind} tokenizer {tok.fingerprint} given")
        if mine["vocab_size"] != tok.vocab_size:
            raise ShardError(f"token store {self.path}: {STORE_FILE}'s tokenizer.vocab_size is "
                             f"{mine['vocab_size']:,}, but its tokenizer has {tok.vocab_size:,} ids: the store is "
                             "damaged (prepare it again)")

    def check_vocab(self, vocab_size: int) -> None:
        if self.max_token >= vocab_size:
            raise ShardError(f"token store {self.path} holds token id {self.max_token}, outside the vocabulary "
                             f"of {vocab_size} (model.vocab_size)")


SHARD_FIELDS = ("tokens", "documents", "n_tokens", "n_documents", "max_token", "tokens_bytes", "documents_bytes",
                "tokens_crc32", "documents_crc32")
_WRITTEN = SHARD_FIELDS[5:]  # sizes and checksums: optional in store.json (older stores have none)


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_meta(path: Path, meta: dict) -> np.dtype:
    """store.json's fields by type and range, its shards' names (files of the store's own folder, each
    listed once) and totals, in one line naming the store and the field; the dtype."""
    if meta.get("format") != FORMAT:
        raise ShardError(f"{path / STORE_FILE} is not a shard token store (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ShardError(f"{path / STORE_FILE} is version {meta.get('version')!r} of the token store; this shard "
                         f"reads version {VERSION}")

    def bad(field: str, problem: str) -> ShardError:
        return ShardError(f"token store {path}: {STORE_FILE}'s {field} {problem}")

    if meta.get("dtype") not in DTYPES:
        raise bad("dtype", f"is {meta.get('dtype')!r}, not one of {', '.join(DTYPES)}")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        raise bad("tokenizer", f"is {tok!r}, not an object")
    for k in ("kind", "fingerprint"):
        if not isinstance(tok.get(k), str):
            raise bad(f"tokenizer.{k}", f"is {tok.get(k)!r}, not a string")
    vocab = tok.get("vocab_size")
    if not _whole(vocab) or vocab < 1:
        raise bad("tokenizer.vocab_size", f"is {vocab!r}, not a whole number above 0")
    if vocab > np.iinfo(dtype).max + 1:
        raise bad("tokenizer.vocab_size", f"is {vocab:,}: more ids than its dtype {dtype.name} holds")
    for k in ("bos_id", "eos_id"):
        if tok.get(k) is not None and not (_whole(tok[k]) and 0 <= tok[k] < vocab):
            raise bad(f"tokenizer.{k}", f"is {tok[k]!r}, not null or an id of the vocabulary (0..{vocab - 1})")
    for k, kind, ok in (("text_field", "a string", lambda v: isinstance(v, str)),
                        ("key", "a string", lambda v: isinstance(v, str)),
                        ("sources", "a list of paths", lambda v: isinstance(v, list) and
                         all(isinstance(x, str) for x in v))):
        if not ok(meta.get(k)):
            raise bad(k, f"is {meta.get(k)!r}, not {kind}")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("shards", "lists no shards" if shards == [] else f"is {shards!r}, not a list of shards")
    seen: dict[Path, str] = {}
    root = path.resolve()
    for i, s in enumerate(shards):
        check_entry(s, vocab, dtype.itemsize, lambda field, problem, i=i: bad(f"shards[{i}]{field}", problem))
        for k in ("tokens", "documents"):
            name = s[k]
            real = (path / name).resolve()
            if not real.is_relative_to(root):  # a link that leads out of the store
                raise bad(f"shards[{i}].{k}", f"names {name}, which is outside the store's own folder (a link that "
                          "leads out)")
            if real in seen:
                raise bad(f"shards[{i}].{k}", f"names {name}, which {seen[real]} names too: each file is one "
                          "shard's")
            seen[real] = f"shards[{i}].{k}"
    for k in ("n_tokens", "n_documents"):
        total = sum(s[k] for s in shards)
        if not _whole(meta.get(k)) or meta[k] < 0:
            raise bad(k, f"is {meta.get(k)!r}, not a whole number of 0 or more")
        if meta[k] != total:
            raise bad(k, f"is {meta[k]:,}, but its shards' add up to {total:,}")
    return dtype


def check_entry(s, vocab: int, itemsize: int, bad, recorded: bool = False) -> None:
    """One shard's entry (in store.json, or a partial's record) by type and range: its files' plain
    names, its counts, its largest id, its sizes and checksums (`recorded`: a record must have them).
    `bad(".field", problem)` makes the error."""
    if not isinstance(s, dict):
        raise bad("", f"is {s!r}, not an object")
    for k in ("tokens", "documents"):
        name = s.get(k)
        if not isinstance(name, str) or name in ("", ".", ".."):
            raise bad(f".{k}", f"is {name!r}, not a file name")
        if any(c in name for c in "/\\\0"):
            raise bad(f".{k}", f"names {name}, which is outside the store's own folder (a shard's files are plain "
                      "names in it)")
    for k in ("n_tokens", "n_documents"):
        if not _whole(s.get(k)) or s[k] < 0:
            raise bad(f".{k}", f"is {s.get(k)!r}, not a whole number of 0 or more")
    top = s.get("max_token")
    if not _whole(top) or not -1 <= top < vocab:
        raise bad(".max_token", f"is {top!r}, not an id of the vocabulary (0..{vocab - 1}), or -1 for no tokens")
    if (top == -1) != (s["n_tokens"] == 0):
        raise bad(".max_token", f"is {top}, and the shard holds {s['n_tokens']:,} tokens (-1 is for none)")
    for k in _WRITTEN:
        if k not in s and not recorded:
            continue
        v = s.get(k)
        if k.endswith("_bytes") and not (_whole(v) and v >= 0):
            raise bad(f".{k}", f"is {v!r}, not a whole number of 0 or more")
        if k.endswith("_crc32") and not (isinstance(v, str) and len(v) == 8 and
                                         all(c in "0123456789abcdef" for c in v)):
            raise bad(f".{k}", f"is {v!r}, not a CRC-32 (8 hex digits)")
    if "tokens_bytes" in s and s["tokens_bytes"] != s["n_tokens"] * itemsize:
        raise bad(".tokens_bytes", f"is {s['tokens_bytes']:,}, not {s['n_tokens']:,} tokens of {itemsize} bytes")


def _open_shard(path: Path, s: dict, dtype: np.dtype) -> np.ndarray:
    f = path / s["tokens"]
    want = s["n_tokens"] * dtype.itemsize
    if not f.is_file():
        raise ShardError(f"shard {f.name} is missing")
    if f.stat().st_size != want:
        raise ShardError(f"shard {f.name} holds {f.stat().st_size:,} bytes, not {want:,} ({s['n_tokens']:,} tokens "
                         f"of {dtype.name})")
    return np.memmap(f, dtype, mode="r") if want else np.zeros(0, dtype)


def _shard_ends(path: Path, s: dict) -> np.ndarray:
    f = path / s["documents"]
    if "documents_bytes" in s and f.is_file() and f.stat().st_size != s["documents_bytes"]:
        raise ShardError(f"{f.name} holds {f.stat().st_size:,} bytes, not {s['documents_bytes']:,}")
    try:
        ends = np.load(f)
    except (OSError, ValueError) as e:
        raise ShardError(f"cannot read {f.name} ({e})") from None
    n = s["n_tokens"]
    if ends.ndim != 1 or ends.dtype.kind not in "iu" or ends.size != s["n_documents"]:
        raise ShardError(f"{f.name} is not {s['n_documents']:,} int64 document ends")
    if ends.size and (np.any(np.diff(ends) < 0) or ends[0] < 0):
        raise ShardError(f"the document ends in {f.name} are not ascending")
    last = int(ends[-1]) if ends.size else 0
    if last != n:
        raise ShardError(f"the documents in {f.name} end at {last:,}, {'past' if last > n else 'before'} the "
                         f"shard's end ({n:,} tokens)")
    return ends


def check_files(path: Path, s: dict, dtype: np.dtype) -> None:
    """A shard's files read whole against its (checked) entry: sizes, document ends, CRC-32s where it
    has them, and its largest id, which must be its max_token."""
    _open_shard(path, s, dtype)
    _shard_ends(path, s)
    crc, top = _scan(path / s["tokens"], dtype)
    if "tokens_crc32" in s and crc != s["tokens_crc32"]:
        raise ShardError(f"shard {s['tokens']} does not match its checksum (CRC-32 {crc}, recorded "
                         f"{s['tokens_crc32']})")
    if top != s["max_token"]:
        raise ShardError(f"shard {s['tokens']} holds ids up to {top:,}, and its max_token is {s['max_token']:,}")
    if "documents_crc32" in s and (crc := _scan(path / s["documents"])[0]) != s["documents_crc32"]:
        raise ShardError(f"{s['documents']} does not match its checksum (CRC-32 {crc}, recorded "
                         f"{s['documents_crc32']})")


def _scan(f: Path, dtype: np.dtype | None = None) -> tuple[str, int]:
    """A file's CRC-32 (8 hex digits) and, read as ids of `dtype`, its largest (-1: none)."""
    crc, top = 0, -1
    with open(f, "rb") as handle:
        while block := handle.read(READ_BYTES):  # a multiple of the itemsize: the file's size was checked
            crc = zlib.crc32(block, crc)
            if dtype is not None:
                top = max(top, int(np.frombuffer(block, dtype).max()))
    return crc_hex(crc), top
