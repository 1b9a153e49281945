"""Documents and the token store: every source kind, round trips, resuming, atomicity, and the
one-line errors bad input gets (naming the file, deleting nothing); the data and tokenizer commands."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shard.cli.app import app
from shard.config.train import DataConfig
from shard.data import store as store_mod
from shard.data.batches import sample_dataset
from shard.data.documents import iter_documents
from shard.data.files import TokenParts
from shard.data.packing import PackedSource, pack
from shard.data.samples import Samples, WindowSource
from shard.data.store import TokenStore, cached_store, is_store, prepare_store
from shard.data.tokenizers import ByteTokenizer, train_bpe
from shard.errors import ShardError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TEXTS = [f"document {i}: " + "the quick brown fox jumps " * (i % 5) + "é✓" for i in range(60)]
CHUNK = 512  # bytes: several chunks, and shards, from tiny files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe(iter(TEXTS * 3), 300, tmp_path_factory.mktemp("tok"))


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def documents(store):
    tokens = np.asarray(store.tokens)
    starts = np.concatenate([[0], store.document_ends[:-1]])
    return [tokens[a:b] for a, b in zip(starts, store.document_ends)]


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_round_trip_decodes_to_the_texts_with_eos(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS[:30] + [""] + TEXTS[30:])  # the empty text is skipped
    store = prepare_store(str(src), tok, tmp_path / "store", workers=2, progress=False, chunk_bytes=CHUNK)
    assert len(store.meta["shards"]) > 2 and store.n_documents == len(TEXTS)
    assert [tok.decode(d) for d in documents(store)] == [t + "<|endoftext|>" for t in TEXTS]
    assert store.tokens.dtype == np.uint16 and store.max_token < tok.vocab_size
    assert store.tokenizer().fingerprint == tok.fingerprint
    store.check_tokenizer(tok)
    # readable with NumPy alone, as docs/data.md says
    meta = json.loads((tmp_path / "store" / "store.json").read_text())
    first = meta["shards"][0]
    raw = np.fromfile(tmp_path / "store" / first["tokens"], dtype=meta["dtype"])
    ends = np.load(tmp_path / "store" / first["documents"])
    assert tok.decode(raw[:ends[0]]) == TEXTS[0] + "<|endoftext|>" and ends[-1] == raw.size


def test_every_source_kind_gives_the_same_documents(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(t)
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:25])
    write_jsonl(tmp_path / "b.jsonl", TEXTS[25:])
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "t.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                          "test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    arrow = sorted((tmp_path / "ds").glob("*.arrow"))[0]
    for i, spec in enumerate([tmp_path / "txt", tmp_path / "*.jsonl", tmp_path / "t.parquet", tmp_path / "ds",
                              tmp_path / "dd", arrow]):
        assert list(iter_documents([str(spec)])) == TEXTS, spec
        store = prepare_store(str(spec), tok, tmp_path / f"s{i}", workers=2, progress=False, chunk_bytes=CHUNK)
        assert [tok.decode(d) for d in documents(store)] == [t + "<|endoftext|>" for t in TEXTS], spec
    assert len(json.loads((tmp_path / "s2" / "store.json").read_text())["shards"]) == 4  # a row group each
    # a dictionary-encoded string column (pandas' categoricals) is text too: it was refused as "not text"
    pq.write_table(pa.table({"text": pa.array(TEXTS).dictionary_encode()}), tmp_path / "dict.parquet")
    assert list(iter_documents([str(tmp_path / "dict.parquet")])) == TEXTS


def test_the_embedded_corpus_with_the_byte_tokenizer(tmp_path):
    store = prepare_store("", ByteTokenizer(), tmp_path / "s", workers=2, progress=False)
    from shard.data.files import embedded_corpus_files

    files = embedded_corpus_files()
    assert store.n_documents == len(files) and store.tokens.dtype == np.uint16  # a document a file, no EOS
    assert ByteTokenizer().decode(documents(store)[0]) == files[0].read_text()


class Killed(Exception):
    pass


def interrupted(monkeypatch, src, tok, out, stop_at):
    """What a run killed (Ctrl-C) while making shard `stop_at` leaves: `out.partial`, the shards before
    it finished and recorded, that one's tokens half-written. One worker, so the patch reaches it."""
    make = store_mod._make_shard

    def dies(job):
        if job[0] == stop_at:
            (Path(job[2]) / store_mod.tokens_name(stop_at)).write_bytes(b"\1\2\3")
            raise Killed
        return make(job)

    monkeypatch.setattr(store_mod, "_make_shard", dies)
    with pytest.raises(Killed):
        prepare_store(str(src), tok, out, workers=1, progress=False, chunk_bytes=CHUNK)
    monkeypatch.undo()
    return out.with_name(out.name + ".partial")


def test_an_interrupted_prepare_continues_to_the_same_store_byte_for_byte(tmp_path, tok, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    whole = prepare_store(str(src), tok, tmp_path / "whole", workers=2, progress=False, chunk_bytes=CHUNK)
    last = len(whole.meta["shards"]) - 1
    out = tmp_path / "store"
    partial = interrupted(monkeypatch, src, tok, out, last)
    assert sorted(p.name for p in partial.glob("done-*.json")) == [f"done-{i:05d}.json" for i in range(last)]
    with pytest.raises(ShardError, match="no store.json .*store.partial is an unfinished one"):
        TokenStore.open(out)  # atomicity: no out before it is whole
    assert not out.exists() and not is_store(partial)
    kept = {p.name: p.stat().st_mtime_ns for p in partial.glob("tokens-*.bin")}
    prepare_store(str(src), tok, out, workers=2, progress=False, chunk_bytes=CHUNK)
    assert files_of(out) == files_of(whole.path) and not partial.exists()
    # the finished shards were reused, not made again
    assert len(kept) == last + 1
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items()
               if name != whole.meta["shards"][last]["tokens"])
    # the same command again: the store is there already
    assert prepare_store(str(src), tok, out, workers=2, progress=False).n_tokens == whole.n_tokens


def test_a_damaged_shard_in_the_partial_is_redone_not_trusted(tmp_path, tok, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    whole = prepare_store(str(src), tok, tmp_path / "whole", workers=2, progress=False, chunk_bytes=CHUNK)
    out = tmp_path / "store"
    assert len(whole.meta["shards"]) >= 5
    partial = interrupted(monkeypatch, src, tok, out, len(whole.meta["shards"]) - 1)
    first = whole.meta["shards"][1]
    flip(partial / first["tokens"], 4)  # the same size: only the checksum tells
    (partial / whole.meta["shards"][2]["documents"]).write_bytes(b"")  # its record says otherwise
    (partial / "done-00003.json").unlink()  # a shard whose record a kill kept from being written
    prepare_store(str(src), tok, out, workers=2, progress=True, chunk_bytes=CHUNK)
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "redoing" in line]
    # shards 1 (a flipped byte), 2 (its documents emptied), 3 (no record) and the last (half-written)
    assert len(said) == 1 and f"redoing 4 shard(s) of {partial}" in said[0], err
    assert f"{first['tokens']} (done-00001.json: shard {first['tokens']} does not match its checksum" in said[0]
    assert files_of(out) == files_of(whole.path)


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_store_is_never_reported_complete(tmp_path, tok, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    out = tmp_path / "store"
    good = prepare_store(str(src), tok, out, workers=2, progress=False, chunk_bytes=CHUNK)
    before = files_of(out)
    assert all(len(s["tokens_crc32"]) == 8 and s["tokens_bytes"] == 2 * s["n_tokens"] for s in good.meta["shards"])
    assert not list(out.glob("done-*")) and not list(out.glob(".*"))
    shard = good.meta["shards"][2]
    flip(out / shard["tokens"], 6)
    TokenStore.open(out)  # opening reads no shard whole
    with pytest.raises(ShardError, match=f"token store {out}: shard {shard['tokens']} does not match its checksum"):
        good.verify()
    with pytest.raises(ShardError) as e:
        prepare_store(str(src), tok, out, workers=2, progress=True, chunk_bytes=CHUNK)
    assert f"--out {out} holds this store, damaged (token store {out}: shard {shard['tokens']} does not match" \
        in str(e.value) and "remove it and run the same command again" in str(e.value) and "\n" not in str(e.value)
    assert "already holds" not in capsys.readouterr().err
    # a shard damaged after its worker wrote it: the partial is not renamed into place
    shutil.rmtree(out)
    make = store_mod._make_shard

    def disk_fails(job):
        shard = make(job)
        if job[0] == 1:
            flip(Path(job[2]) / shard["tokens"], 0)
        return shard

    monkeypatch.setattr(store_mod, "_make_shard", disk_fails)
    with pytest.raises(ShardError, match="store.partial: shard tokens-00001.bin does not match what was written "
                                         r"\(done-00001.json: shard tokens-00001.bin does not match its checksum"):
        prepare_store(str(src), tok, out, workers=1, progress=False, chunk_bytes=CHUNK)
    assert not out.exists() and out.with_name("store.partial").is_dir()
    monkeypatch.undo()
    again = prepare_store(str(src), tok, out, workers=2, progress=False, chunk_bytes=CHUNK)
    again.verify()
    assert files_of(out) == before


def test_a_store_written_before_checksums_still_opens_and_verifies(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    out = tmp_path / "store"
    store = prepare_store(str(src), tok, out, workers=2, progress=False, chunk_bytes=CHUNK)
    meta = json.loads((out / "store.json").read_text())
    for s in meta["shards"]:
        for k in ("tokens_bytes", "documents_bytes", "tokens_crc32", "documents_crc32"):
            del s[k]
    (out / "store.json").write_text(json.dumps(meta))
    TokenStore.open(out).verify()
    assert prepare_store(str(src), tok, out, workers=2, progress=False).n_tokens == store.n_tokens
    # without checksums, verify still reads every id: one the recorded max_token does not cover is found
    shard = meta["shards"][0]
    raw = np.fromfile(out / shard["tokens"], np.uint16)
    raw[1] = shard["max_token"] + 1
    raw.tofile(out / shard["tokens"])
    with pytest.raises(ShardError, match=f"shard {shard['tokens']} holds ids up to {shard['max_token'] + 1}, and "
                                         f"its max_token is {shard['max_token']}"):
        TokenStore.open(out).verify()


def test_a_partial_or_store_of_other_sources_is_refused_and_kept(tmp_path, tok):
    a, b = write_jsonl(tmp_path / "a.jsonl", TEXTS), write_jsonl(tmp_path / "b.jsonl", TEXTS[:10])
    prepare_store(str(a), tok, tmp_path / "s", workers=2, progress=False)
    with pytest.raises(ShardError, match=f"--out {tmp_path / 's'} already exists .*other sources"):
        prepare_store(str(b), tok, tmp_path / "s", workers=2, progress=False)
    os.rename(tmp_path / "s", tmp_path / "t.partial")
    with pytest.raises(ShardError, match="t.partial is an unfinished store made from other sources"):
        prepare_store(str(b), tok, tmp_path / "t", workers=2, progress=False)
    assert (tmp_path / "t.partial" / "store.json").is_file() and a.is_file() and b.is_file()


def test_bad_sources_name_the_file_and_leave_no_store(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "good.jsonl", TEXTS)
    write_jsonl(tmp_path / "nofield.jsonl", TEXTS, field="body")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    (tmp_path / "bin.txt").write_bytes(b"ab\0cd")
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"text": ["x"]}),
                          "b": datasets.Dataset.from_dict({"text": ["y"]})}).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .save_to_disk(str(tmp_path / "emptyds"))
    cases = {"nofield.jsonl": r"nofield.jsonl line \d+ has no field 'text'",
             "empty.jsonl": r"empty.jsonl holds no documents",
             "blank.jsonl": r"blank.jsonl holds no text",
             "ints.parquet": r"column 'text' of Parquet file .*ints.parquet is int64, not text",
             "bin.txt": r"bin.txt looks binary",
             "dd": r"dataset .*dd holds the splits a, b and no 'train'",
             "emptyds": r"emptyds holds no documents",
             "missing.jsonl": r"missing.jsonl does not exist",
             "*.csv": r"\*.csv matches no file"}
    for name, message in cases.items():
        with pytest.raises(ShardError, match=message):
            prepare_store([str(tmp_path / "good.jsonl"), str(tmp_path / name)], tok, tmp_path / "out", workers=2,
                          progress=False, chunk_bytes=CHUNK)
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists(), name
    # a row without the field in a later chunk, found by a worker: the same one line
    write_jsonl(tmp_path / "late.jsonl", TEXTS + ["x"] * 3)
    with open(tmp_path / "late.jsonl", "a") as f:
        f.write('{"body": "no text here"}\n')
    with pytest.raises(ShardError, match=f"late.jsonl line {len(TEXTS) + 4} has no field 'text'"):
        prepare_store(str(tmp_path / "late.jsonl"), tok, tmp_path / "out", workers=2, progress=False,
                      chunk_bytes=CHUNK)
    assert not (tmp_path / "out").exists() and (tmp_path / "late.jsonl").is_file()


def test_a_damaged_store_names_the_file(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    good = prepare_store(str(src), tok, tmp_path / "good", workers=2, progress=False, chunk_bytes=CHUNK)
    shard0 = good.meta["shards"][0]

    def damaged(name, how):
        copy = tmp_path / name
        shutil.copytree(good.path, copy)
        how(copy)
        with pytest.raises(ShardError) as e:
            TokenStore.open(copy)
        assert str(copy) in str(e.value) and "\n" not in str(e.value)
        return str(e.value)

    assert f"shard {shard0['tokens']} is missing" in damaged("missing", lambda d: (d / shard0["tokens"]).unlink())
    assert "holds 3 bytes" in damaged("short", lambda d: (d / shard0["tokens"]).write_bytes(b"abc"))
    past = np.load(good.path / shard0["documents"]) + 5
    assert "past the shard's end" in damaged("past", lambda d: np.save(d / shard0["documents"], past))
    assert "not ascending" in damaged("order", lambda d: np.save(d / shard0["documents"], past[::-1] - 5))
    assert "is not a shard token store" in damaged("format", lambda d: (d / "store.json").write_text('{"a": 1}'))
    other = train_bpe(iter(TEXTS[:20]), 280, tmp_path / "other")
    with pytest.raises(ShardError, match=f"made with the huggingface tokenizer {tok.fingerprint}, not .* "
                                         f"{other.fingerprint}"):
        good.check_tokenizer(other)
    with pytest.raises(ShardError, match=f"good holds token id {good.max_token}, outside the vocabulary of 100"):
        good.check_vocab(100)
    good.check_vocab(tok.vocab_size)


@pytest.fixture(scope="module")
def made(tmp_path_factory, tok):
    """A store to copy and damage."""
    root = tmp_path_factory.mktemp("made")
    src = write_jsonl(root / "a.jsonl", TEXTS)
    return prepare_store(str(src), tok, root / "store", workers=2, progress=False, chunk_bytes=CHUNK)


def edited(made, tmp_path, edit):
    """A copy of the store `made` with its store.json edited by `edit(meta)`."""
    copy = tmp_path / "copy"
    shutil.copytree(made.path, copy)
    meta = json.loads((copy / "store.json").read_text())
    edit(meta)
    (copy / "store.json").write_text(json.dumps(meta))
    return copy


def shard_field(k, v, i=0):
    return lambda m: m["shards"][i].__setitem__(k, v)


def tok_field(k, v):
    return lambda m: m["tokenizer"].__setitem__(k, v)


def twice(m):
    m["shards"].append(dict(m["shards"][0]))
    m["n_tokens"] += m["shards"][0]["n_tokens"]
    m["n_documents"] += m["shards"][0]["n_documents"]


STORE_JSON_DAMAGE = {
    "dtype int8": (lambda m: m.__setitem__("dtype", "int8"), "dtype is 'int8', not one of uint16, uint32"),
    "no tokenizer": (lambda m: m.pop("tokenizer"), "tokenizer is None, not an object"),
    "kind": (tok_field("kind", 3), "tokenizer.kind is 3, not a string"),
    "vocab 0": (tok_field("vocab_size", 0), "tokenizer.vocab_size is 0, not a whole number above 0"),
    "vocab bool": (tok_field("vocab_size", True), "tokenizer.vocab_size is True, not a whole"),
    "vocab str": (tok_field("vocab_size", "300"), "tokenizer.vocab_size is '300', not a whole"),
    "vocab too big": (tok_field("vocab_size", 70000), "tokenizer.vocab_size is 70,000: more ids than its dtype "
                                                      "uint16 holds"),
    "eos outside": (tok_field("eos_id", 300), r"tokenizer.eos_id is 300, not null or an id of the vocabulary \(0..299\)"),
    "bos str": (tok_field("bos_id", "0"), "tokenizer.bos_id is '0', not null"),
    "sources": (lambda m: m.__setitem__("sources", "a.jsonl"), "sources is 'a.jsonl', not a list of paths"),
    "no shards": (lambda m: m.__setitem__("shards", []), "shards lists no shards"),
    "shards dict": (lambda m: m.__setitem__("shards", {}), "shards is {}, not a list of shards"),
    "shard str": (lambda m: m["shards"].__setitem__(0, "tokens-00000.bin"), r"shards\[0\] is 'tokens-00000.bin', not "
                                                                            "an object"),
    "up": (shard_field("tokens", "../secret/tokens.bin"), r"shards\[0\].tokens names ../secret/tokens.bin, which "
                                                          "is outside the store"),
    "absolute": (shard_field("documents", "/etc/passwd", 1), r"shards\[1\].documents names /etc/passwd, which is "
                                                             "outside the store"),
    "folder": (shard_field("tokens", "tokenizer/tokens-00000.bin"), r"shards\[0\].tokens names "
                                                                    "tokenizer/tokens-00000.bin, which is outside"),
    "dots": (shard_field("tokens", ".."), r"shards\[0\].tokens is '..', not a file name"),
    "twice": (twice, r"shards\[\d+\].tokens names tokens-00000.bin, which shards\[0\].tokens names too"),
    "tokens as documents": (shard_field("documents", "tokens-00000.bin"), r"shards\[0\].documents names "
                                                                          r"tokens-00000.bin, which shards\[0\].tokens"),
    "n_tokens str": (lambda m: m["shards"][0].__setitem__("n_tokens", str(m["shards"][0]["n_tokens"])),
                     r"shards\[0\].n_tokens is '\d+', not a whole number"),  # the right count, as a string
    "n_documents bool": (shard_field("n_documents", False), r"shards\[0\].n_documents is False, not a whole"),
    "n_tokens negative": (shard_field("n_tokens", -2), r"shards\[0\].n_tokens is -2, not a whole number of 0 or more"),
    "max_token -1": (shard_field("max_token", -1), r"shards\[0\].max_token is -1, and the shard holds [\d,]+ tokens"),
    "max_token vocab": (shard_field("max_token", 300), r"shards\[0\].max_token is 300, not an id of the vocabulary"),
    "max_token float": (shard_field("max_token", 12.0), r"shards\[0\].max_token is 12.0, not an id"),
    "crc": (shard_field("tokens_crc32", 12), r"shards\[0\].tokens_crc32 is 12, not a CRC-32"),
    "tokens_bytes": (shard_field("tokens_bytes", 4), r"shards\[0\].tokens_bytes is 4, not [\d,]+ tokens of 2 bytes"),
    "total str": (lambda m: m.__setitem__("n_tokens", str(m["n_tokens"])), "n_tokens is '[0-9]+', not a whole"),
    "total off": (lambda m: m.__setitem__("n_documents", m["n_documents"] + 1), r"n_documents is [\d,]+, but its "
                                                                                "shards' add up to"),
}


@pytest.mark.parametrize("case", STORE_JSON_DAMAGE)
def test_store_json_is_checked_whole_in_one_line_naming_the_field(made, tmp_path, case):
    edit, message = STORE_JSON_DAMAGE[case]
    copy = edited(made, tmp_path, edit)
    with pytest.raises(ShardError, match=message) as e:
        TokenStore.open(copy)
    assert str(e.value).startswith(f"token store {copy}: store.json's ") and "\n" not in str(e.value)


def test_a_shard_listed_once_with_counts_that_match_its_files(made, tmp_path):
    """The counts are checked against the files: a shard of tokens with no document ends is refused."""
    shard = made.meta["shards"][0]

    def no_documents(m):
        m["shards"][0]["n_documents"] = 0
        m["n_documents"] -= shard["n_documents"]
        m["shards"][0].pop("documents_bytes", None)

    copy = edited(made, tmp_path, no_documents)
    np.save(copy / shard["documents"], np.zeros(0, np.int64))
    with pytest.raises(ShardError, match=f"token store {copy}: the documents in {shard['documents']} end at 0, "
                                         f"before the shard's end \\({shard['n_tokens']:,} tokens\\)"):
        TokenStore.open(copy)


def test_a_store_whose_record_says_another_vocabulary_than_its_tokenizer_is_refused(made, tmp_path, tok):
    def smaller(m):  # and the recorded max_token with it: opening reads no ids to see otherwise
        m["tokenizer"]["vocab_size"] = 200
        for s in m["shards"]:
            s["max_token"] = min(s["max_token"], 199)

    copy = edited(made, tmp_path, smaller)
    store = TokenStore.open(copy)
    with pytest.raises(ShardError, match=f"token store {copy}: store.json's tokenizer.vocab_size is 200, but its "
                                         "tokenizer has 300 ids"):
        store.check_tokenizer(tok)
    with pytest.raises(ShardError, match="tokenizer.vocab_size is 1,000, but its tokenizer has 300"):
        sample_dataset(str(edited(made, tmp_path / "b", tok_field("vocab_size", 1000))), 1024, 16, 0)


@pytest.mark.parametrize("packing", ["concat", "packed"])
def test_ids_above_the_vocabulary_stop_the_batch_that_reads_them(made, tmp_path, packing):
    copy = tmp_path / "copy"
    shutil.copytree(made.path, copy)
    shard = made.meta["shards"][1]
    raw = np.fromfile(copy / shard["tokens"], np.uint16)
    raw[2] = 65535  # store.json still says max_token < 300: opening the store cannot tell
    raw.tofile(copy / shard["tokens"])
    samples = sample_dataset(str(copy), 384, 16, 0, data=DataConfig(packing=packing))
    with pytest.raises(ShardError, match=f"token store {copy} holds token id 65,535, outside its vocabulary of 300 "
                                         "ids") as e:
        samples.rows(0, samples.windows)  # every row once
    assert "\n" not in str(e.value)
    sample_dataset(str(made.path), 384, 16, 0, data=DataConfig(packing=packing)).rows(0, samples.windows)


def test_a_uint32_id_past_int32_is_not_read_as_padding():
    at_vocab = TokenParts([np.array([1, 2, 300, 3], "<u2")], vocab=300, label="token store v")
    with pytest.raises(ShardError, match="token store v holds token id 300, outside its vocabulary of 300 ids"):
        WindowSource(at_vocab, 2).read(np.arange(2))  # the first id past the vocabulary, not only far past it
    tokens = TokenParts([np.array([1, 2, 0xFFFFFFFF, 3, 4], "<u4")], vocab=70000, label="token store s")
    with pytest.raises(ShardError, match="token store s holds token id 4,294,967,295, outside its vocabulary of "
                                         "70,000 ids"):
        WindowSource(tokens, 4).read(np.arange(2))
    assert WindowSource(tokens[3:], 4).read(np.arange(1)).tolist() == [[3, 4, -1, -1, -1]]
    # packed rows hold int32 ids, where this id is -1, as padding is: told apart by the segments
    ends = np.array([2, 5])
    with pytest.raises(ShardError, match="token store s holds token id 4,294,967,295"):
        Samples(PackedSource(tokens, pack(ends, 4)), None).rows(0, 2)
    assert Samples(PackedSource(tokens[3:], pack(ends[:1], 4)), None).rows(0, 1)["tokens"].tolist() == \
        [[3, 4, -1, -1, -1]]


def test_cached_store_prepares_once_and_reuses(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    first = cached_store([str(src)], tok, tmp_path / "cache")
    stamp = (first / "store.json").stat().st_mtime_ns
    assert cached_store([str(src)], tok, tmp_path / "cache") == first and is_store(first)
    assert (first / "store.json").stat().st_mtime_ns == stamp
    write_jsonl(src, TEXTS[:5])  # other data: another store
    assert cached_store([str(src)], tok, tmp_path / "cache") != first


def test_the_commands(tmp_path, tok):
    import transformers

    runner = CliRunner()
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    done = runner.invoke(app, ["tokenizer", "train", str(src), "--vocab-size", "300", "--out", str(tmp_path / "t")])
    assert done.exit_code == 0 and "trained a byte-level BPE of 300 ids" in done.output, done.output
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    from shard.data.tokenizers import load_tokenizer

    mine = load_tokenizer(str(tmp_path / "t"))
    for text in TEXTS[:5] + ["  spaces\tand\nlines ✓"]:
        assert auto(text)["input_ids"] == mine.encode_batch([text])[0].tolist()
    done = runner.invoke(app, ["data", "prepare", str(src), "--tokenizer", str(tmp_path / "t"),
                               "--out", str(tmp_path / "s"), "--workers", "2"])
    assert done.exit_code == 0 and f"{len(TEXTS)} documents" in done.output, done.output
    assert TokenStore.open(tmp_path / "s").n_documents == len(TEXTS)
    bad = write_jsonl(tmp_path / "bad.jsonl", TEXTS, field="body")
    for args in (["data", "prepare", str(bad), "--tokenizer", str(tmp_path / "t"), "--out", str(tmp_path / "x")],
                 ["tokenizer", "train", str(bad), "--out", str(tmp_path / "y")]):
        done = runner.invoke(app, args)
        assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1, done.output
        assert "bad.jsonl line 1 has no field 'text'" in done.output, done.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_invalid_utf8_in_a_text_file_is_counted_at_start(tmp_path, capsys):
    """Invalid UTF-8 in a .txt source became U+FFFD without a word: the preparation says how many
    sequences, in how many files (a U+FFFD written in the file is no replacement)."""
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_bytes("caf\xe9 \ufffd ok".encode("latin-1", "ignore") + b" \xff\xfe end")
    (tmp_path / "txt" / "b.txt").write_text("clean \ufffd text")
    store = prepare_store(str(tmp_path / "txt"), ByteTokenizer(), tmp_path / "s", workers=1)
    assert store.n_documents == 2
    said = capsys.readouterr().err
    assert (f"warning: 3 invalid UTF-8 sequence(s) in 1 text file(s) read as U+FFFD (the replacement character), "
            f"3 of them in {tmp_path / 'txt' / 'a.txt'}") in said.replace("\n", ""), said


def test_a_full_disk_names_the_file_it_was_writing(tmp_path):
    """It said `OSError: 1778221 requested and 1040384 written`. A file size limit stands in for the full
    disk: its EFBIG reaches the writer as ENOSPC does, an error that names no file."""
    import resource
    import signal

    from shard.errors import user_error

    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the plan fits, the first shard does not
    try:
        with pytest.raises(OSError) as e:
            prepare_store(str(src), "byte", tmp_path / "s", workers=1, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert str(user_error(e.value)) == f"{tmp_path / 's.partial' / 'tokens-00000.bin'}: File too large"


def test_a_killed_prepare_leaves_no_worker_writing_and_the_next_one_continues(tmp_path, tok):
    """Its workers wrote on into OUT.partial after a kill -9; now they die with it, and while they live a
    second prepare of the same --out is refused."""
    import subprocess
    import sys
    import time

    src, out = write_jsonl(tmp_path / "a.jsonl", TEXTS), tmp_path / "store"
    stuck = (f"import os, time\nfrom shard.data import store\ndef stuck(job):\n    os.write(1, b'%d\\n' % os.getpid())\n"
             f"    time.sleep(300)\nstore._make_shard = stuck\nstore.prepare_store({str(src)!r}, {str(tok.path)!r}, "
             f"{str(out)!r}, workers=2, progress=False, chunk_bytes={CHUNK})\n")
    parent = subprocess.Popen([sys.executable, "-c", stuck], stdout=subprocess.PIPE, text=True)
    workers = []  # each worker's pid in one write (print's text and newline could interleave with the other's)
    while len(workers) < 2:
        line = parent.stdout.readline()
        assert line, "the preparation ended before its workers started"
        if line.strip().isdigit():  # among whatever else the preparation prints
            workers.append(int(line))

    def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped by init) counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    try:
        with pytest.raises(ShardError, match="store.partial is being written by another shard data prepare"):
            prepare_store(str(src), tok, out, workers=1, progress=False)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, workers))
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, 9)
    assert prepare_store(str(src), tok, out, workers=1, progress=False).n_documents == len(TEXTS)


def test_a_partial_folder_a_killed_command_left_is_removed_by_the_next_one(tmp_path):
    """export-hf, import-hf and tokenizer train write `.OUT.partial-*`; a killed one's stayed for good."""
    from shard.paths import left_behind, writing, written_whole

    stale, live = tmp_path / ".out.partial-stale", tmp_path / ".out.partial-live"
    for folder in (stale, live, tmp_path / ".other.partial-x"):
        folder.mkdir()
        (folder / "weights").write_text("half")
    said = []
    with writing(live, "busy"), written_whole(tmp_path / "out", say=said.append) as partial:
        (partial / "done").write_text("whole")
        assert not left_behind(partial)  # a command writing it holds it: a second one leaves it alone
    assert (tmp_path / "out" / "done").read_text() == "whole"
    assert not stale.exists() and live.exists() and (tmp_path / ".other.partial-x").exists()
    assert said == [f"removed 1 unfinished folder(s) that a stopped command left: {stale}"]
