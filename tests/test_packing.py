"""Packed rows and data mixtures on the host: the plan, the batches it makes, and the order of samples
as a pure function of the seed and the global sample index (no devices)."""

import numpy as np
import pytest

from shard.config.train import DataConfig
from shard.data.batches import sample_dataset, split_window
from shard.data.corpus import Corpus
from shard.data.mixture import BLOCK, MixtureSamples, block_counts, phases, read_mixture
from shard.data.packing import PackedSource, pack, packed_batch, pieces
from shard.data.samples import Samples
from shard.errors import ShardError


def _documents(lengths):
    ends = np.cumsum(lengths)
    return np.arange(ends[-1], dtype=np.int32), ends


def test_every_target_of_every_document_is_trained_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=500)
    tokens, ends = _documents(lengths)
    plan = pack(ends, seq_len=16)
    batch = packed_batch(PackedSource(tokens, plan).read(np.arange(plan.rows)))
    kept = batch["mask"] > 0
    # the stream counts up, so within a document a target is its input + 1, and never across one
    assert np.all(batch["targets"][kept] == batch["inputs"][kept] + 1)
    starts = np.concatenate([[0], ends[:-1]])
    assert np.array_equal(np.sort(batch["targets"][kept]), np.setdiff1d(np.arange(ends[-1]), starts))
    assert plan.efficiency > 0.9


def test_segments_and_positions_restart_per_document():
    tokens, ends = _documents([3, 4, 20])  # seq 8: rows of 9 slots; the long one is cut in pieces
    plan = pack(ends, seq_len=8)
    rows = PackedSource(tokens, plan).read(np.arange(plan.rows))
    batch = packed_batch(rows)
    first = np.flatnonzero([0 in r for r in rows["tokens"]])[0]  # the row holding document 1
    assert rows["tokens"][first][:7].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert rows["segments"][first][:7].tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert rows["positions"][first][:7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert batch["mask"][first][:6].tolist() == [1, 1, 0, 1, 1, 1]  # 2 -> 3 crosses a boundary
    assert rows["tokens"][first][7:].tolist() == [-1, -1]  # padding, segment 0, masked
    assert rows["segments"][first][7:].tolist() == [0, 0] and batch["mask"][first][6:].tolist() == [0, 0]
    # the 20-token document: pieces of 9 overlapping by one, each a segment from position 0
    starts, lengths = pieces(ends, 8)
    assert list(zip(starts.tolist(), lengths.tolist())) == [(0, 3), (3, 4), (7, 9), (15, 9), (23, 4)]


def test_packed_rows_are_a_pure_function_of_seed_and_index():
    tokens, ends = _documents(np.random.default_rng(1).integers(2, 30, size=200))
    a = Samples.shuffled(PackedSource(tokens, pack(ends, 16)), seed=3, seq_len=16)
    b = Samples.shuffled(PackedSource(tokens, pack(ends, 16)), seed=3, seq_len=16)
    c = Samples.shuffled(PackedSource(tokens, pack(ends, 16)), seed=4, seq_len=16)
    rows = a.rows(100, 140)
    # read in other blocks (another process count or batch split), the same rows
    again = {k: np.concatenate([b.rows(100, 117)[k], b.rows(117, 140)[k]]) for k in rows}
    assert all(np.array_equal(rows[k], again[k]) for k in rows)
    assert not np.array_equal(rows["tokens"], c.rows(100, 140)["tokens"])
    assert a.filled(0, 10) == sum(min(int((r >= 0).sum()), 16) for r in a.rows(0, 10)["tokens"])


def test_corpus_split_on_a_document_boundary():
    tokens, ends = _documents([5, 5, 5, 5])
    kept, held = Corpus(tokens, ends, "c").split(0.25, seq_len=4, packed=True)
    assert kept.document_ends.tolist() == [5, 10, 15] and held.document_ends.tolist() == [5]
    assert np.asarray(held.tokens).tolist() == list(range(15, 20))
    with pytest.raises(ShardError, match="1 document"):
        Corpus(tokens[:5], ends[:1], "c").split(0.25, 4, packed=True)


def test_block_counts_follow_the_weights():
    assert block_counts([3, 1], 8).tolist() == [6, 2]
    assert block_counts([1, 1, 1], 1024).sum() == 1024
    assert block_counts([1.0, 0.0], 16).tolist() == [16, 0]


def test_capped_source_leaves_the_mixture():
    # source 0 capped at 3 blocks' worth of its slots, source 1 unbounded
    ph = phases([1, 1], [3 * 512, None])
    assert [(p.first_block, p.last_block, p.counts.tolist()) for p in ph] == [(0, 3, [512, 512]), (3, None, [0, 1024])]
    assert ph[1].before.tolist() == [1536, 1536]
    spent = phases([1, 1], [512, 512])
    assert spent[-1].last_block == 1


class _Counter:
    """A source whose k-th sample is [k]: shows which of its own samples a mixture reads."""

    def __init__(self, n):
        self.windows = n
        self.packed = False

    def rows_at(self, index):
        return np.asarray(index)[:, None]

    def filled_at(self, index):
        return len(index)


def test_mixture_is_a_pure_function_of_seed_and_index():
    mix = MixtureSamples([_Counter(100), _Counter(100)], [3, 1], [None, None], seed=0, labels=["a", "b"])
    source, index = mix.locate(0, 4 * BLOCK)
    assert abs((source == 0).mean() - 0.75) < 1e-3
    for s in (0, 1):  # each source's own samples in order, none skipped or repeated
        assert index[source == s].tolist() == list(range((source == s).sum()))
    other = MixtureSamples([_Counter(100), _Counter(100)], [3, 1], [None, None], seed=0, labels=["a", "b"])
    assert np.array_equal(np.concatenate([other.locate(1000, 1500)[1], other.locate(1500, 3000)[1]]), index[1000:3000])
    assert mix.rows(5, 9).ravel().tolist() == index[5:9].tolist()
    assert mix.shares() == [0.75, 0.25]
    reseeded = MixtureSamples([_Counter(100), _Counter(100)], [3, 1], [None, None], seed=1, labels=["a", "b"])
    assert not np.array_equal(reseeded.locate(0, 4 * BLOCK)[0], source)  # another seed, another order


def test_spent_mixture_says_so():
    mix = MixtureSamples([_Counter(10)], [1], [10], seed=0, labels=["a"])
    mix.locate(0, BLOCK)
    with pytest.raises(ShardError, match="spent after 1,024 samples"):
        mix.locate(BLOCK, BLOCK + 1)


def test_mixture_file_of_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 2000)
    (tmp_path / "b.txt").write_text("b" * 2000)
    mix = tmp_path / "mix.toml"
    mix.write_text('[[sources]]\npath = "a.txt"\nweight = 3\n[[sources]]\npath = "b.txt"\nweight = 1\n')
    samples = sample_dataset(str(mix), 256, 16, seed=0, data=DataConfig())
    first = samples.rows(0, BLOCK)
    share_a = float((first[:, 0] == ord("a")).mean())
    assert share_a == 0.75
    # the same stream read in pieces, and from a fresh copy (a resume)
    again = sample_dataset(str(mix), 256, 16, seed=0, data=DataConfig())
    assert np.array_equal(np.concatenate([again.rows(0, 300), again.rows(300, BLOCK)]), first)
    assert split_window(first)["inputs"].shape == (BLOCK, 16)


@pytest.mark.parametrize("text, message", [
    ('[[sources]]\npath = "a.txt"\nweight = 0\n', "weight must be a finite number above 0, got 0"),
    ('[[sources]]\npath = "a.txt"\nweight = -1\n', "weight must be a finite number above 0"),
    ('[[sources]]\npath = "gone.txt"\nweight = 1\n', "gone.txt does not exist"),
    ('[[sources]]\nweight = 1\n', "needs a path"),
    ('[[sources]]\npath = "a.txt"\nweight = 1\nepochs = -2\n', "epochs must be"),
    ('sources = []\n', "names no sources"),
    ('[[sources]]\npath = "a.txt"\nweight = 1\nshare = 2\n', "unknown key 'share'"),
    ('[[sources]\n', "cannot read it"),
    ('[[sources]]\npath = "a.txt"\nweight = 1\n[[sources]]\npath = "./a.txt"\nweight = 2\n',
     "source 2: .*a.txt is source 1 already; give it one entry, with the weight of both"),
])
def test_bad_mixtures_are_one_line(tmp_path, text, message):
    (tmp_path / "a.txt").write_text("hello")
    mix = tmp_path / "mix.toml"
    mix.write_text(text)
    with pytest.raises(ShardError, match=message) as e:
        read_mixture(str(mix))
    assert "\n" not in str(e.value) and str(mix) in str(e.value)


def test_packing_needs_documents():
    with pytest.raises(ShardError, match="synthetic data has none"):
        sample_dataset("synthetic", 256, 16, seed=0, data=DataConfig(packing="packed"))


def test_samples_of_windows_count_every_token():
    s = Samples(None, None, seq_len=8)
    assert s.filled_at(np.arange(4)) == 32


def test_mixture_globs_are_relative_to_its_file_and_mixtures_do_not_nest(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.txt").write_text("a" * 100)
    mix = tmp_path / "m" / "mix.toml"
    mix.write_text('[[sources]]\npath = "*.txt"\nweight = 1\n')
    monkeypatch.chdir(tmp_path)  # elsewhere: the glob is still the mixture folder's
    (entry,) = read_mixture(str(mix))
    assert entry.path == str(tmp_path / "m" / "*.txt")
    nested = tmp_path / "m" / "outer.toml"
    nested.write_text('[[sources]]\npath = "mix.toml"\nweight = 1\n')
    with pytest.raises(ShardError, match="is a mixture itself"):
        read_mixture(str(nested))


def test_the_summary_says_how_many_files_and_documents_were_read(tmp_path):
    for name, text in (("a.txt", "x" * 100), ("b.txt", "y" * 60)):
        (tmp_path / name).write_text(text)
    folder = sample_dataset(str(tmp_path), 256, 16, 0)
    assert folder.describe() == "2 files, 161 tokens in 10 windows"  # with a separator between files
    ends = np.array([5, 12, 30])
    one = Samples.shuffled(PackedSource(np.arange(30, dtype=np.int32), pack(ends, 16)), 0, 16,
                    Corpus(np.arange(30), ends, "x.jsonl", files=1))
    assert one.describe().startswith("1 file, 3 documents, 30 tokens in ")
