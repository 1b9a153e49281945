"""The three tokenizers behind one protocol: bytes, a Hugging Face tokenizer.json and a SentencePiece
model; saved and loaded back byte for byte; files that are not tokenizers are one line."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from shard.data.tokenizers import (ByteTokenizer, Tokenizer, document_ids, encode, load_tokenizer, padded_vocab,
                                   train_bpe)
from shard.errors import ShardError

TEXT = "def main(argv):\n    return 0  # café ✓"


def _lines(n: int = 3000) -> list[str]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()][:n]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(iter(_lines()), 400, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines()), model_prefix=str(prefix), vocab_size=300,
                                   model_type="bpe", minloglevel=3)
    return Path(f"{prefix}.model")


def test_bytes():
    tok = load_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 256 and tok.eos_id is None
    ids = encode(tok, TEXT)
    assert tok.decode(ids) == TEXT and document_ids(tok, ids).tolist() == ids.tolist()


def test_hugging_face_tokenizer_round_trips_and_ends_documents_with_eos(bpe, tmp_path):
    tok = load_tokenizer(str(bpe.path.parent))  # the folder
    assert isinstance(tok, Tokenizer) and tok.kind == "huggingface" and tok.vocab_size == 400
    assert tok.eos_id == 0 and tok.special_tokens == {"<|endoftext|>": 0} and not tok.add_bos
    ids = encode(tok, TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.decode(ids) == TEXT
    assert document_ids(tok, ids).tolist() == [*ids.tolist(), 0]
    tok.save(tmp_path / "copy")
    again = load_tokenizer(str(tmp_path / "copy"))
    assert again.fingerprint == tok.fingerprint and encode(again, TEXT).tolist() == ids.tolist()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "copy")(TEXT)["input_ids"] == ids.tolist()


def test_sentencepiece_starts_documents_with_bos(sentencepiece_model, tmp_path):
    tok = load_tokenizer(str(sentencepiece_model))
    assert tok.kind == "sentencepiece" and tok.vocab_size == 300 and tok.add_bos
    ids = encode(tok, "return value")
    assert tok.decode(ids) == "return value"
    assert document_ids(tok, ids).tolist() == [tok.bos_id, *ids.tolist(), tok.eos_id]
    assert {"<s>", "</s>"} <= set(tok.special_tokens)
    tok.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.model").is_file()
    assert load_tokenizer(str(tmp_path / "saved")).fingerprint == tok.fingerprint


def test_the_vocabulary_pads_to_a_multiple_of_128():
    assert [padded_vocab(n) for n in (1, 128, 129, 32000, 50257)] == [128, 128, 256, 32000, 50304]


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", "{}", "is not a Hugging Face tokenizer"),
    ("tokenizer.json", "not json at all", "is not a Hugging Face tokenizer"),
    ("weights.model", "garbage", "is not a SentencePiece model"),
    ("notes.txt", "hello", "is not a Hugging Face tokenizer"),
])
def test_a_file_that_is_not_a_tokenizer_is_one_line(tmp_path, name, content, message):
    if name.endswith(".model"):
        pytest.importorskip("sentencepiece")
    (tmp_path / name).write_text(content)
    with pytest.raises(ShardError, match=message) as e:
        load_tokenizer(str(tmp_path / name))
    assert str(tmp_path / name) in str(e.value) and "\n" not in str(e.value)


def test_missing_tokenizers_are_one_line(tmp_path):
    with pytest.raises(ShardError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(ShardError, match="holds no tokenizer.json, tokenizer.model"):
        load_tokenizer(str(tmp_path))


def test_byte_tokenizer_saved_is_read_back(tmp_path):
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert np.array_equal(encode(load_tokenizer(str(tmp_path)), "ab"), [97, 98])
