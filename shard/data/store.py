"""The token store made: sources tokenized once into memory-mapped shards that NumPy alone reads (the
layout on disk, and how a store is opened and checked: shard.data.token_store).

Each document is `document_ids` (BOS where the tokenizer uses one, EOS where it has one); empty texts are
skipped. One shard per chunk of the sources (shard.data.documents), made by a pool of worker processes
that read their chunk and write their shard themselves, then its record (`DIR.partial/done-00000.json`:
the shard's entry of store.json, sizes and CRC-32s included; its presence says the shard is finished).
The store is built in `DIR.partial` and renamed to DIR when whole and every shard matches its record; a
run that stops leaves the partial, and the same command continues it, redoing the shards that do not."""

import contextlib
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from shard.data.documents import CHUNK_BYTES, Chunk, plan_chunks, read_chunk_counted
from shard.data.files import STORE_FILE, is_store
from shard.data.files import STORE_FORMAT as FORMAT
from shard.data.sources import DataSource, describe_data, source_signature
from shard.data.token_store import (SHARD_FIELDS, VERSION, TokenStore, check_entry, check_files, crc_hex,
                                     documents_name, tokens_name)
from shard.data.tokenizers import Tokenizer, load_tokenizer, read_json_object
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR, write_atomic, write_text_atomic, writing, written_whole
from shard.processes import die_with_parent

PLAN_FILE = "plan.json"


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


def _start_worker(tokenizer_dir: str, dtype: str, text_field: str, parent: int | None = None) -> None:
    if parent is not None:  # a pool's worker: a killed prepare leaves none writing into its partial
        die_with_parent(parent)
    _WORKER.update(tok=load_tokenizer(tokenizer_dir), dtype=np.dtype(dtype), text_field=text_field)


def _make_shard(job: tuple[int, dict, str]) -> dict:
    index, chunk, folder = job
    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    texts, replaced = read_chunk_counted(Chunk.from_json(chunk), _WORKER["text_field"])
    try:
        tokens, ends = encode_documents(tok, texts, dtype)
    except ShardError as e:  # a text too long to cut
        raise ShardError(f"{', '.join(chunk['files'])}: {e}") from None
    folder = Path(folder)
    documents = io.BytesIO()
    np.save(documents, ends)
    documents = documents.getbuffer()
    for name, data in ((tokens_name(index), tokens), (documents_name(index), documents)):
        write_atomic(folder / name, data, sync=False)  # a full disk: the error names the file
    record = {"tokens": tokens_name(index), "documents": documents_name(index), "n_tokens": int(tokens.size),
              "n_documents": int(ends.size), "max_token": int(tokens.max()) if tokens.size else -1,
              "tokens_bytes": tokens.nbytes, "documents_bytes": documents.nbytes,
              "tokens_crc32": crc_hex(zlib.crc32(tokens)), "documents_crc32": crc_hex(zlib.crc32(documents))}
    # the record last: its presence says the shard is finished, and what its files must hold
    write_text_atomic(folder / record_name(index), json.dumps(record) + "\n")
    return {"index": index, **record, "nbytes": chunk["nbytes"], "replaced": replaced}


def _shard_done(folder: Path, index: int, dtype: np.dtype, vocab_size: int) -> tuple[dict | None, str]:
    """(a shard a stopped run finished, "") when its record and files agree, else (None, what is wrong;
    "" when the shard was never started)."""
    record = folder / record_name(index)
    if not record.is_file():
        made = (folder / tokens_name(index)).exists() or (folder / documents_name(index)).exists()
        return None, "not recorded as finished" if made else ""
    try:
        s = read_json_object(record)
        check_entry(s, vocab_size, dtype.itemsize, recorded=True,
                     bad=lambda field, problem: ShardError(f"{field[1:] or 'it'} {problem}"))
        if (s["tokens"], s["documents"]) != (tokens_name(index), documents_name(index)):
            raise ShardError(f"names {s['tokens']} and {s['documents']}")
        check_files(folder, s, dtype)
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
                                      "chunks": [c.to_json() for c in chunks]}, say)
    # held until the store is renamed into place, by this process and its workers: a second prepare of the
    # same --out is refused while either lives
    with writing(partial, f"{partial} is being written by another shard data prepare (or its workers); wait for "
                          "it to end, or choose another --out"):
        if not created:
            plan = read_json_object(partial / PLAN_FILE) if (partial / PLAN_FILE).is_file() else {}
            if plan.get("key") != key:
                raise ShardError(f"{partial} is an unfinished store made from other sources, tokenizer or text "
                                 "field; remove it to start over, or choose another --out")
            chunks = [Chunk.from_json(c) for c in plan["chunks"]]
            say(f"continuing {partial}")
        dtype = store_dtype(tok.vocab_size)
        shards = _made_shards(partial, chunks, specs, tok, dtype, text_field, workers, say, created)
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "tokenizer": tokenizer_info(tok),
                "text_field": text_field, "sources": specs, "key": key,
                "shards": [{k: s[k] for k in SHARD_FIELDS} for s in shards],
                "n_tokens": sum(s["n_tokens"] for s in shards), "n_documents": sum(s["n_documents"] for s in shards)}
        write_text_atomic(partial / STORE_FILE, json.dumps(meta, indent=1) + "\n")
        os.rename(partial, out)  # whole, or not there
    for i in range(len(chunks)):  # store.json holds what the records said
        (out / record_name(i)).unlink(missing_ok=True)
    return TokenStore.open(out)


def _made_shards(partial: Path, chunks: list[Chunk], specs: list[str], tok: Tokenizer, dtype, text_field: str,
                 workers: int | None, say: "_Say", created: bool) -> list[dict]:
    """Every shard of the partial, made or (continuing it) checked and redone where it does not match its
    record, then read back against its record."""
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
    if note := replaced_note([s.get("replaced", {}) for s in shards]):
        say(note)
    # every shard read back against its record before the store is called whole
    for s in shards:
        found, problem = _shard_done(partial, s["index"], dtype, tok.vocab_size)
        if found is None:
            raise ShardError(f"token store {partial}: shard {tokens_name(s['index'])} does not match what was "
                             f"written ({problem or 'it is gone'}); the store is not finished: run the same command "
                             "again to redo it")
    return shards


def replaced_note(replaced: list[dict[str, int]]) -> str:
    """The line that says how much invalid UTF-8 the text files held (read as U+FFFD), or ""."""
    files = {f: n for part in replaced for f, n in part.items()}
    if not files:
        return ""
    first = min(files)
    return (f"warning: {sum(files.values()):,} invalid UTF-8 sequence(s) in {len(files):,} text file(s) read as "
            f"U+FFFD (the replacement character), {files[first]:,} of them in {first}")


def _start_partial(partial: Path, tok: Tokenizer, plan: dict, say: "_Say") -> None:
    """The partial's tokenizer and plan, made beside it and renamed into place: a partial always has both."""
    with written_whole(partial, say) as tmp:
        tok.save(tmp / TOKENIZER_DIR)
        write_text_atomic(tmp / PLAN_FILE, json.dumps(plan, indent=1) + "\n")


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
            with _one_thread_each(), ctx.Pool(workers, _start_worker, (*init, os.getpid())) as pool:
                for s in pool.imap_unordered(_make_shard, todo):
                    results[s["index"]] = s
                    advance(s)
    return [results[i] for i in range(len(chunks))]


@contextlib.contextmanager
def _one_thread_each():
    """Workers inherit these: one tokenizer thread each, as many processes as cores (a process a core
    beats a pool of threads in each: no oversubscription, no locks between them); and PYTHONSAFEPATH, so
    a spawned worker's `python -c` never imports from the working folder (`multiprocessing/` there would
    run before the worker takes its parent's import path)."""
    saved = {k: os.environ.get(k) for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONSAFEPATH")}
    os.environ.update(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONSAFEPATH="1")
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
