"""The token store: sources tokenized once into memory-mapped shards that NumPy alone reads.

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

Each document is `document_ids` (BOS where the tokenizer uses one, EOS where it has one); empty texts are
skipped. One shard per chunk of the sources (shard.data.documents), made by a pool of worker processes
that read their chunk and write their shard themselves, then its record (`DIR.partial/done-00000.json`:
the shard's entry of store.json, sizes and CRC-32s included; its presence says the shard is finished).
The store is built in `DIR.partial` and renamed to DIR when whole and every shard matches its record; a
run that stops leaves the partial, and the same command continues it, redoing the shards that do not.

`TokenStore.open` trusts nothing in store.json: every field is checked for its type and range, the
shards must be files of the store's own folder, and the counts must match the files. It reads no
shard whole (a store of 10B tokens is 20 GB, opened at every start of a run), so the ids are checked
where a batch reads them (shard.data.samples.check_ids); `verify` reads every shard against its
checksums."""

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from shard.data.documents import CHUNK_BYTES, Chunk, plan_chunks, read_chunk
from shard.data.files import STORE_FILE, TokenParts, is_store
from shard.data.files import STORE_FORMAT as FORMAT
from shard.data.sources import DataSource, describe_data, source_signature
from shard.data.tokenizers import Tokenizer, load_tokenizer, read_json_object
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR, current_umask, write_text_atomic

VERSION = 1
PLAN_FILE = "plan.json"
DTYPES = ("uint16", "uint32")
READ_BYTES = 16 << 20  # what a checksum reads at a time


def tokens_name(i: int) -> str:
    return f"tokens-{i:05d}.bin"


def documents_name(i: int) -> str:
    return f"documents-{i:05d}.npy"


def record_name(i: int) -> str:
    return f"done-{i:05d}.json"


def store_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _described(sources) -> list[DataSource]:
    """Sources given as a spec, a DataSource, or a list of them, described (each once)."""
    given = [sources] if isinstance(sources, str | DataSource) else list(sources)
    return [s if isinstance(s, DataSource) else describe_data(str(s)) for s in given]


def _tokenizer(tokenizer) -> Tokenizer:
    return load_tokenizer(str(tokenizer)) if isinstance(tokenizer, str | Path) else tokenizer


def tokenizer_info(tok: Tokenizer) -> dict:
    return {"kind": tok.kind, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id if tok.add_bos else None, "eos_id": tok.eos_id}


def store_key(sources, tokenizer, text_field: str = "text") -> str:
    """What a store is made of: the sources' signatures, the tokenizer's fingerprint, the text field and
    the format's version, hashed."""
    tok = _tokenizer(tokenizer)
    what = {"version": VERSION, "sources": [source_signature(s) for s in _described(sources)],
            "tokenizer": [tok.kind, tok.fingerprint], "text_field": text_field}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def encode_documents(tok: Tokenizer, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
    """The non-empty texts as one stream of `document_ids`, and the end offset of each document."""
    texts = [t for t in texts if t]
    ids = tok.encode_batch(texts) if texts else []
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    eos = tok.eos_id
    extra = (bos is not None) + (eos is not None)
    lengths = np.fromiter((a.size for a in ids), np.int64, len(ids)) + extra
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    if extra:
        special = np.zeros(out.size, bool)
        if bos is not None:
            out[ends - lengths] = bos
            special[ends - lengths] = True
        if eos is not None:
            out[ends - 1] = eos
            special[ends - 1] = True
        if ids:
            out[~special] = np.concatenate(ids)
    elif ids:
        np.concatenate(ids, out=out, casting="unsafe")
    return out, ends


# -- the workers: each loads the tokenizer once, reads its chunk and writes its shard itself --

_WORKER: dict = {}


def _start_worker(tokenizer_dir: str, dtype: str, text_field: str) -> None:
    _WORKER.update(tok=load_tokenizer(tokenizer_dir), dtype=np.dtype(dtype), text_field=text_field)


def _make_shard(job: tuple[int, dict, str]) -> dict:
    index, chunk, folder = job
    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    tokens, ends = encode_documents(tok, read_chunk(Chunk.from_json(chunk), _WORKER["text_field"]), dtype)
    folder = Path(folder)
    documents = io.BytesIO()
    np.save(documents, ends)
    documents = documents.getbuffer()
    for name, data in ((tokens_name(index), tokens), (documents_name(index), documents)):
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)
    record = {"tokens": tokens_name(index), "documents": documents_name(index), "n_tokens": int(tokens.size),
              "n_documents": int(ends.size), "max_token": int(tokens.max()) if tokens.size else -1,
              "tokens_bytes": tokens.nbytes, "documents_bytes": documents.nbytes,
              "tokens_crc32": _crc(zlib.crc32(tokens)), "documents_crc32": _crc(zlib.crc32(documents))}
    # the record last: its presence says the shard is finished, and what its files must hold
    write_text_atomic(folder / record_name(index), json.dumps(record) + "\n")
    return {"index": index, **record, "nbytes": chunk["nbytes"]}


def _crc(value: int) -> str:
    return f"{value:08x}"


def _shard_done(folder: Path, index: int, dtype: np.dtype, vocab_size: int) -> tuple[dict | None, str]:
    """(a shard a stopped run finished, "") when its record and files agree, else (None, what is wrong;
    "" when the shard was never started)."""
    record = folder / record_name(index)
    if not record.is_file():
        made = (folder / tokens_name(index)).exists() or (folder / documents_name(index)).exists()
        return None, "not recorded as finished" if made else ""
    try:
        s = read_json_object(record)
        _check_entry(s, vocab_size, dtype.itemsize, recorded=True,
                     bad=lambda field, problem: ShardError(f"{field[1:] or 'it'} {problem}"))
        if (s["tokens"], s["documents"]) != (tokens_name(index), documents_name(index)):
            raise ShardError(f"names {s['tokens']} and {s['documents']}")
        _check_files(folder, s, dtype)
    except ShardError as e:
        return None, f"{record.name}: {e}"
    return {"index": index, **s}, ""


def _clear_shard(folder: Path, index: int) -> None:
    for name in (record_name(index), tokens_name(index), documents_name(index)):
        (folder / name).unlink(missing_ok=True)


def prepare_store(sources, tokenizer, out, *, text_field: str = "text", workers: int | None = None,
                  progress: bool = True, chunk_bytes: int = CHUNK_BYTES) -> "TokenStore":
    """Tokenize `sources` (one spec or a list; or shard.data.sources.DataSource) with `tokenizer` (a
    Tokenizer or its spec) into a token store at `out`, over `workers` processes (default: every core).
    Continues the `out.partial` a stopped run left, redoing the shards that do not match their records;
    an `out` that already holds this store is returned as it is, once every shard matches its checksums."""
    sources, tok, out = _described(sources), _tokenizer(tokenizer), Path(out)
    specs = [s.path for s in sources]
    key = store_key(sources, tok, text_field)
    partial = out.with_name(out.name + ".partial")
    say = _Say(progress)
    if out.exists():
        if is_store(out) and read_json_object(out / STORE_FILE).get("key") == key:
            try:
                store = TokenStore.open(out)
                store.verify()
            except ShardError as e:
                raise ShardError(f"--out {out} holds this store, damaged ({e}): remove it and run the same "
                                 "command again to make it anew") from None
            say(f"{out} already holds this store (same sources, tokenizer and text field)")
            return store
        what = "a token store made from other sources, tokenizer or text field" if is_store(out) else "something"
        raise ShardError(f"--out {out} already exists and holds {what}; choose another --out")
    created = not partial.exists()
    if created:
        # bad sources fail here, before any file is made
        chunks = plan_chunks(specs, text_field, chunk_bytes, parts=[s.documents for s in sources])
        _start_partial(partial, tok, {"key": key, "sources": specs, "text_field": text_field,
                                      "chunks": [c.to_json() for c in chunks]})
    else:
        plan = read_json_object(partial / PLAN_FILE) if (partial / PLAN_FILE).is_file() else {}
        if plan.get("key") != key:
            raise ShardError(f"{partial} is an unfinished store made from other sources, tokenizer or text field; "
                             "remove it to start over, or choose another --out")
        chunks = [Chunk.from_json(c) for c in plan["chunks"]]
        say(f"continuing {partial}")
    dtype = store_dtype(tok.vocab_size)
    done, redo = {}, []
    for tmp in [] if created else partial.glob(".*.tmp-*"):  # what workers killed mid-write left
        tmp.unlink(missing_ok=True)
    for i in range(0 if created else len(chunks)):
        shard, problem = _shard_done(partial, i, dtype, tok.vocab_size)
        if shard is not None:
            done[i] = shard
        elif problem:
            _clear_shard(partial, i)
            redo.append(f"{tokens_name(i)} ({problem})")
    if redo:
        more = f" and {len(redo) - 1} more" if len(redo) > 1 else ""
        say(f"redoing {len(redo)} shard(s) of {partial} left unfinished or damaged: {redo[0]}{more}")
    try:
        shards = _run_workers(partial, chunks, done, dtype, text_field, workers, say)
    except ShardError:
        if created:  # the sources must change, and with them the store: nothing here is worth keeping
            shutil.rmtree(partial, ignore_errors=True)
        raise
    for source, spec in enumerate(specs):
        if not sum(s["n_documents"] for s, c in zip(shards, chunks) if c.source == source):
            if created:
                shutil.rmtree(partial, ignore_errors=True)
            raise ShardError(f"data path {spec or 'the embedded corpus'} holds no text (field {text_field!r})")
    # every shard read back against its record before the store is called whole
    for s in shards:
        found, problem = _shard_done(partial, s["index"], dtype, tok.vocab_size)
        if found is None:
            raise ShardError(f"token store {partial}: shard {tokens_name(s['index'])} does not match what was "
                             f"written ({problem or 'it is gone'}); the store is not finished: run the same command "
                             "again to redo it")
    n_tokens, n_documents = sum(s["n_tokens"] for s in shards), sum(s["n_documents"] for s in shards)
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "tokenizer": tokenizer_info(tok),
            "text_field": text_field, "sources": specs, "key": key,
            "shards": [{k: s[k] for k in SHARD_FIELDS} for s in shards],
            "n_tokens": n_tokens, "n_documents": n_documents}
    write_text_atomic(partial / STORE_FILE, json.dumps(meta, indent=1) + "\n")
    os.rename(partial, out)  # whole, or not there
    for i in range(len(chunks)):  # store.json holds what the records said
        (out / record_name(i)).unlink(missing_ok=True)
    return TokenStore.open(out)


def _start_partial(partial: Path, tok: Tokenizer, plan: dict) -> None:
    """The partial's tokenizer and plan, made beside it and renamed into place: a partial always has both."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{partial.name}-", dir=partial.parent))
    try:
        tok.save(tmp / TOKENIZER_DIR)
        (tmp / PLAN_FILE).write_text(json.dumps(plan, indent=1) + "\n")
        tmp.chmod(0o777 & ~current_umask())
        tmp.rename(partial)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _run_workers(partial: Path, chunks: list[Chunk], done: dict, dtype, text_field: str, workers: int | None,
                 say: "_Say") -> list[dict]:
    todo = [(i, chunks[i].to_json(), str(partial)) for i in range(len(chunks)) if i not in done]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    init = (str(partial / TOKENIZER_DIR), dtype.name, text_field)
    results = dict(done)
    with say.progress(sum(c["nbytes"] for _, c, _ in todo)) as advance:
        if workers == 1:  # no pool to start for one worker's work
            _start_worker(*init)
            for job in todo:
                s = _make_shard(job)
                results[s["index"]] = s
                advance(s)
        else:
            # fork starts fast and needs no `if __name__ == "__main__"` in the caller's script; spawn where
            # the parent holds JAX's threads, which a fork copies mid-flight
            ctx = multiprocessing.get_context("spawn" if "jax" in sys.modules else "fork")
            with _one_thread_each(), ctx.Pool(workers, _start_worker, init) as pool:
                for s in pool.imap_unordered(_make_shard, todo):
                    results[s["index"]] = s
                    advance(s)
    return [results[i] for i in range(len(chunks))]


@contextlib.contextmanager
def _one_thread_each():
    """Workers inherit these: one tokenizer thread each, as many processes as cores (a process a core
    beats a pool of threads in each: no oversubscription, no locks between them)."""
    saved = {k: os.environ.get(k) for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    os.environ.update(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Say:
    """Lines and the progress bar (documents/s, tokens/s, ETA by input bytes) on stderr, or nothing."""

    def __init__(self, on: bool):
        self.on = on
        if on:
            from rich.console import Console  # here: the worker processes import this module, and say nothing

            self.console = Console(stderr=True, highlight=False, emoji=False, markup=False)

    def __call__(self, line: str) -> None:
        if self.on:
            self.console.print(line, soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, total_bytes: int):
        start, counts = time.perf_counter(), {"docs": 0, "tokens": 0}
        if not self.on:
            yield lambda s: None
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rate]}"),
                      TimeRemainingColumn(), console=self.console, transient=True) as bar:
            task = bar.add_task("", total=max(total_bytes, 1), rate="")

            def advance(s: dict) -> None:
                counts["docs"] += s["n_documents"]
                counts["tokens"] += s["n_tokens"]
                secs = max(time.perf_counter() - start, 1e-9)
                bar.update(task, advance=s.get("nbytes", 0),
                           rate=f"{counts['docs'] / secs:,.0f} docs/s {counts['tokens'] / secs:,.0f} tokens/s")

            yield advance


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
                _check_files(self.path, s, dtype)
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
        _check_entry(s, vocab, dtype.itemsize, lambda field, problem, i=i: bad(f"shards[{i}]{field}", problem))
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


def _check_entry(s, vocab: int, itemsize: int, bad, recorded: bool = False) -> None:
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


def _check_files(path: Path, s: dict, dtype: np.dtype) -> None:
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
    return _crc(crc), top


def cached_store(sources, tokenizer, cache_dir, text_field: str = "text") -> Path:
    """The token store of raw sources (specs or their DataSources) in `cache_dir/<key>`, prepared the
    first time and reused after. Processes of one job on one host take a file lock: one prepares, the
    others wait and reuse it."""
    sources, tok = _described(sources), _tokenizer(tokenizer)
    cache_dir = Path(cache_dir)
    out = cache_dir / store_key(sources, tok, text_field)
    if is_store(out):
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{out.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not is_store(out):
            start = time.perf_counter()
            store = prepare_store(sources, tok, out, text_field=text_field)
            secs = time.perf_counter() - start
            _Say(True)(f"prepared {', '.join(s.path for s in sources) or 'the embedded corpus'} into the data cache: "
                       f"{store.n_documents:,} documents, {store.n_tokens:,} tokens in {secs:.1f}s "
                       f"({store.n_tokens / max(secs, 1e-9):,.0f} tokens/s), {out}")
    return out
