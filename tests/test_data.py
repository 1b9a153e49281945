"""Token sources, determinism, padding, and the sharded global batch."""

import dataclasses

import numpy as np
import pytest

from shard.config.train import EvalConfig
from shard.data.batches import (BatchStream, eval_samples, repetition_note, sample_dataset, split_window,
                                 training_samples)
from shard.data.files import embedded_corpus_files, load_tokens
from shard.data.samples import SyntheticSource, WindowSource
from shard.data.sources import describe_data, unused_files_note
from shard.data.tokenizers import ByteTokenizer
from shard.errors import ShardError
from shard.testing import fake_mesh, tiny_config


def test_embedded_corpus_is_real_text():
    files = embedded_corpus_files()
    assert len(files) > 50
    tokens = load_tokens("", 256)
    assert tokens.size > 1_000_000
    assert "def " in ByteTokenizer().decode(tokens[:20000])


def test_same_seed_same_samples_other_seed_other_samples():
    a = sample_dataset("", 256, 64, seed=1)
    b = sample_dataset("", 256, 64, seed=1)
    c = sample_dataset("", 256, 64, seed=2)
    assert all(np.array_equal(a[i], b[i]) for i in range(10))
    assert not all(np.array_equal(a[i], c[i]) for i in range(10))


def test_epochs_are_reshuffled(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij" * 10)
    ds = sample_dataset(str(tmp_path / "t.txt"), 256, 9, seed=0)
    n = len(WindowSource(load_tokens(str(tmp_path / "t.txt"), 256), 9))
    first = [ds[i][0] for i in range(n)]
    second = [ds[i][0] for i in range(n, 2 * n)]
    assert sorted(first) == sorted(second) and first != second


def test_evaluation_holds_out_the_tail_of_the_data_and_training_never_reads_it(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.int32))  # token id = position: where a window is from
    path = str(tmp_path / "t.npy")
    cfg = tiny_config("1x1", data__path=path, data__seq_len=9, model__vocab_size=1000, eval__every=5,
                      eval__holdout=0.1)
    train, held = training_samples(cfg), eval_samples(cfg)
    train_ids = {int(t) for i in range(300) for t in train[i] if t >= 0}
    held_ids = {int(t) for i in range(50) for t in held[i] if t >= 0}
    assert max(train_ids) < min(held_ids) == 900  # 111 windows of 9 steps: the last 11 held out
    assert max(held_ids) == 999
    # without evaluation nothing is held out; with eval.path the held-out data is that file
    assert max(int(t) for i in range(300) for t in training_samples(dataclasses.replace(cfg, eval=EvalConfig()))[i]) == 999
    np.save(tmp_path / "e.npy", np.full(50, 7, np.int32))
    other = dataclasses.replace(cfg, eval=EvalConfig(every=5, path=str(tmp_path / "e.npy")))
    assert {int(t) for t in eval_samples(other)[0] if t >= 0} == {7}
    assert max(int(t) for i in range(300) for t in training_samples(other)[i]) == 999


def test_too_little_data_to_hold_out_is_an_error(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij")
    cfg = tiny_config("1x1", data__path=str(tmp_path / "t.txt"), data__seq_len=9, eval__every=5)
    with pytest.raises(ShardError, match=r"holds 1 window\(s\) of 10 tokens: too few to hold out eval.holdout=0.05"):
        training_samples(cfg)
    with pytest.raises(ShardError, match="eval.holdout must be between 0 and 1"):
        tiny_config("1x1", eval__holdout=1.0)


def test_data_smaller_than_one_batch_is_named(tmp_path):
    (tmp_path / "t.txt").write_text("hello world!")
    small = sample_dataset(str(tmp_path / "t.txt"), 256, 32, seed=0)
    assert repetition_note(small, 8, 32) == ("the training data holds 1 window(s) of 33 tokens, fewer than one "
                                             "global batch of 8: every batch repeats them")
    assert repetition_note(small, 1, 32) is None
    assert repetition_note(sample_dataset("synthetic", 256, 32, seed=0), 8, 32) is None


def test_short_last_window_is_padded_and_masked():
    src = WindowSource(np.arange(10, dtype=np.int32), 4)
    assert len(src) == 3
    last = split_window(src[2][None])
    assert last["inputs"].tolist() == [[8, 9, 0, 0]]
    assert last["mask"].tolist() == [[1, 0, 0, 0]]


def test_a_text_folder_skips_hidden_and_cache_folders(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    for hidden in (".git/objects/ab", "__pycache__"):
        (tmp_path / hidden).mkdir(parents=True)
        (tmp_path / hidden / "blob").write_bytes(b"x\x00\x01binary")
    assert ByteTokenizer().decode(load_tokens(str(tmp_path), 256)) == "hello"


def test_a_linked_folder_is_read_once_and_a_loop_ends(tmp_path):
    """Linked folders were skipped in silence (Path.rglob does not follow them)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").write_text("linked")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "b.txt").write_text("own")
    (tmp_path / "data" / "part").symlink_to(tmp_path / "real")
    (tmp_path / "data" / "again").symlink_to(tmp_path / "real")  # the same folder twice: read once
    (tmp_path / "real" / "up").symlink_to(tmp_path / "data")  # a loop
    # folders in name order on every host: "again" (the real folder's first name), then b.txt; "part" is
    # the same real folder, read once
    assert ByteTokenizer().decode(load_tokens(str(tmp_path / "data"), 256)) == "linked\nown"
    # read once for training and its held-out tail, again once a file changes
    assert load_tokens(str(tmp_path / "data"), 256) is load_tokens(str(tmp_path / "data"), 256)
    before = load_tokens(str(tmp_path / "data"), 256)
    (tmp_path / "real" / "a.txt").write_text("linked, longer")
    assert load_tokens(str(tmp_path / "data"), 256) is not before


def test_a_link_to_nothing_in_a_data_folder_is_named(tmp_path):
    """It was left out in silence: a shard whose disk was not mounted trained on the rest."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("here")
    (tmp_path / "data" / "b.txt").symlink_to(tmp_path / "unmounted" / "b.txt")
    with pytest.raises(ShardError, match=f"data folder {tmp_path / 'data'}: {tmp_path / 'data' / 'b.txt'} links to "
                                         f"{tmp_path / 'unmounted' / 'b.txt'}, which does not exist"):
        load_tokens(str(tmp_path / "data"), 256)


def test_small_vocabulary_token_files_in_uint8_and_an_eval_seed_at_the_top(tmp_path):
    """uint8 token files were taken for bytes of text (refused under 256 ids); the largest seed made the
    evaluation's seed + 1 fall outside grain's range."""
    np.save(tmp_path / "u8.npy", np.arange(200, dtype=np.uint8) % 64)
    assert load_tokens(str(tmp_path / "u8.npy"), 64).size == 200
    (tmp_path / "t.txt").write_text("x" * 3000)
    cfg = tiny_config("1x1", data__path=str(tmp_path / "t.txt"), seed=2**32 - 1, eval__every=1)
    assert eval_samples(cfg)[0].shape == (33,)


def test_a_folder_of_token_shards_is_read_in_place_as_one_stream(tmp_path):
    """A folder of .bin shards was concatenated into memory (a copy of the corpus per process, and a
    second one for evaluation); it is read through the memory maps, window for window as one file."""
    from shard.data.files import TokenParts

    stream = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint16)
    (tmp_path / "shards").mkdir()
    for i, (a, b) in enumerate([(0, 300), (300, 300), (300, 710), (710, 1000)]):  # one shard empty
        stream[a:b].tofile(tmp_path / "shards" / f"{i}.bin")
    stream.tofile(tmp_path / "one.bin")
    tokens = load_tokens(str(tmp_path / "shards"), 256)
    assert isinstance(tokens, TokenParts) and all(isinstance(p, np.memmap) for p in tokens.parts if p.size)
    assert tokens.size == 1000 and tokens.max() == stream.max() and tokens[10:990].min() == stream[10:990].min()
    np.testing.assert_array_equal(np.asarray(tokens[250:750]), stream[250:750])
    every = np.arange(len(WindowSource(stream, 15)))  # the last window runs past the end: padded, masked
    np.testing.assert_array_equal(WindowSource(tokens, 15).read(every), WindowSource(stream, 15).read(every))
    for part in ("train", "eval"):
        shards, one = (sample_dataset(str(p), 256, 15, seed=3, holdout=0.2, part=part)
                       for p in (tmp_path / "shards", tmp_path / "one.bin"))
        np.testing.assert_array_equal(shards.rows(0, 40), one.rows(0, 40))


def test_token_files_and_folders(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int32))
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "b.bin")
    assert load_tokens(str(tmp_path / "a.npy"), 256).size == 100
    assert load_tokens(str(tmp_path / "b.bin"), 256).size == 50
    assert load_tokens(str(tmp_path), 256).size == 150
    text = tmp_path / "text"
    text.mkdir()
    (text / "x.txt").write_text("hello")
    (text / "y.txt").write_text("world")
    assert ByteTokenizer().decode(load_tokens(str(text), 256)) == "hello\nworld"
    # token files win over text in one folder, and train says what it leaves unread
    assert load_tokens(str(tmp_path), 256).size == 150
    assert unused_files_note(describe_data(str(tmp_path))) == (f"data folder {tmp_path} holds 2 token file(s) (.npy/.bin), so its "
                                                "2 other file(s) are not read (e.g. text/x.txt)")
    assert unused_files_note(describe_data(str(text))) is None
    assert unused_files_note(describe_data(str(tmp_path / "a.npy"))) is None


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.txt", "does not exist"),
    (lambda d: (d / "empty.txt").write_text("") and None or d / "empty.txt", "is empty"),
    (lambda d: (d / "one.txt").write_text("x") and None or d / "one.txt", "holds 1 token: training needs at least 2"),
    (lambda d: (np.save(d / "big.npy", np.array([1, 300])), d / "big.npy")[1], "token id 300, outside"),
    (lambda d: (np.save(d / "neg.npy", np.array([1, -1])), d / "neg.npy")[1], "token id -1, outside 0..255"),
    (lambda d: "/dev/zero", "not a regular file"),
    (lambda d: (d / "a.png").write_bytes(b"\x89PNG\x00\x00") and d, "a.png looks binary"),
    (lambda d: (np.savez(d / "z.npz", a=np.arange(3)), (d / "z.npz").rename(d / "z.npy"), d / "z.npy")[2],
     "is an archive of arrays"),
    # numpy tried it as a pickle and said "If you trust the file you can load it unsafely"
    (lambda d: (d / "junk.npy").write_bytes(bytes(range(100))) and None or d / "junk.npy", "is not an .npy array"),
])
def test_bad_data(tmp_path, make, message):
    with pytest.raises(ShardError, match=message):
        load_tokens(str(make(tmp_path)), 256)


def test_a_runs_data_is_described_once_and_each_path_listed_once(tmp_path, monkeypatch):
    """Reading a run's data decided again and again what its path was (a mixture file read 5 times, a
    folder walked 4 times for training and 4 more for its held-out tail): prepare describes it once, and
    the samples, the data cache's store and the start-up summary read that description."""
    import json
    import sys

    from shard.data import files, mixture
    from shard.data.batches import data_summary
    from shard.training.prepare import _training_data

    (tmp_path / "texts").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "texts" / name).write_text(name * 400)
    np.save(tmp_path / "t.npy", np.arange(2000, dtype=np.int32) % 256)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)))
    mix = tmp_path / "mix.toml"
    mix.write_text("".join(f'[[sources]]\npath = "{p}"\nweight = 1\n' for p in ("texts", "t.npy", "docs.jsonl")))
    calls = {"list_source": [], "read_mixture": []}
    for module, name in ((files, "list_source"), (mixture, "read_mixture")):
        original = getattr(module, name)

        def counted(path, *args, _original=original, _calls=calls[name]):
            _calls.append(str(path))
            return _original(path, *args)

        for loaded in [m for n, m in sys.modules.items() if n.startswith("shard.data")]:
            if getattr(loaded, name, None) is original:
                monkeypatch.setattr(loaded, name, counted)
    cfg = tiny_config("1x1", data__path=str(mix), data__seq_len=16, eval__every=1,
                      data__cache=str(tmp_path / "cache"))
    dataset, held = _training_data(cfg)
    assert "mixture: " in data_summary(cfg, dataset) and held.parts[2].windows  # the JSONL was prepared and read
    assert calls["read_mixture"] == [str(mix)]
    assert sorted(calls["list_source"]) == sorted([str(mix), *(str(tmp_path / p) for p in ("texts", "t.npy",
                                                                                           "docs.jsonl"))])


def test_synthetic_is_in_vocab_and_deterministic():
    s = SyntheticSource(1000, 16, seed=3)
    assert np.array_equal(s[5], SyntheticSource(1000, 16, seed=3)[5])
    assert s[5].max() < 1000 and s[5].shape == (17,)


def test_global_batch_is_sharded_and_advances():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = fake_mesh("2x4")
    ds = sample_dataset("", 256, 16, seed=0)
    stream = BatchStream(ds, 8, 16, NamedSharding(mesh, P("data", None)))
    batch = stream.next()
    assert batch["inputs"].shape == (8, 16) and batch["inputs"].sharding.spec == P("data", None)
    expected = split_window(np.stack([ds[i] for i in range(8)]))
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), expected["inputs"])
    np.testing.assert_array_equal(np.asarray(batch["targets"]), expected["targets"])
    assert stream.position == 8
    second = stream.next()
    np.testing.assert_array_equal(np.asarray(second["inputs"]),
                                  split_window(np.stack([ds[i] for i in range(8, 16)]))["inputs"])
