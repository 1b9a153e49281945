"""The three tokenizers behind one protocol: bytes, a Hugging Face tokenizer.json and a SentencePiece
model; saved and loaded back byte for byte; files that are not tokenizers are one line."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from shard.data.tokenizers import (ByteTokenizer, Tokenizer, describe, document_ids, encode, load_tokenizer,
                                   padded_vocab, train_bpe)
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


def _bare_bpe(folder: Path, special: list[str]) -> Path:
    """A byte-level BPE as the `tokenizers` library saves one: tokenizer.json alone, no tokenizer_config.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_lines(300), trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_bare_tokenizer_json_takes_eos_from_its_special_tokens_and_its_export_names_them(tmp_path):
    """A tokenizer.json with no tokenizer_config.json: shard ended its documents with <|endoftext|>, said
    nothing of where that came from, and its export had no config, so transformers' tokenizer had no
    eos_token (lm-eval's `hf` backend failed on it: tests/test_harness.py)."""
    from transformers import AutoTokenizer

    from shard.run.tokenizer import name_special_tokens

    bare = _bare_bpe(tmp_path / "bare", ["<pad>", "<|endoftext|>", "<s>"])
    tok = load_tokenizer(str(bare))
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.add_bos) == (0, 1, 2, False)
    assert describe(tok) == ("huggingface (300 ids, eos 1 <|endoftext|> (no tokenizer_config.json: taken from its "
                             "special tokens))")
    ids = encode(tok, TEXT)
    assert document_ids(tok, ids).tolist() == [*ids.tolist(), 1]
    tok.save(tmp_path / "run")  # a run's copy stays byte for byte the tokenizer it was given
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["tokenizer.json"]
    tok.save(tmp_path / "export")
    name_special_tokens(tmp_path / "export")  # what export-hf does to the tokenizer it writes
    hf = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert (hf.eos_token, hf.bos_token, hf.pad_token) == ("<|endoftext|>", "<s>", "<pad>")
    assert hf(TEXT)["input_ids"] == ids.tolist()
    again = load_tokenizer(str(tmp_path / "export"))
    assert (again.eos_id, again.bos_id, again.pad_id, again.eos_guessed) == (1, 2, 0, "")
    # a config that names some of them keeps its keys; the rest are added
    config = {"chat_template": "{{ messages }}", "eos_token": None, "model_max_length": 64}
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert describe(load_tokenizer(str(bare))).endswith("eos 1 <|endoftext|> (tokenizer_config.json names none: "
                                                        "taken from its special tokens))")
    name_special_tokens(bare)
    written = json.loads((bare / "tokenizer_config.json").read_text())
    assert written == config | {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                "bos_token": "<s>", "pad_token": "<pad>"}
    # none of the usual names among its special tokens: the start-up line says its documents have no end
    assert describe(load_tokenizer(str(_bare_bpe(tmp_path / "none", ["<|stop|>"])))) == "huggingface (300 ids, no eos)"


def test_bos_added_by_a_post_processor_starts_documents(tmp_path):
    """Llama-3 style: the tokenizer.json's TemplateProcessing post-processor adds BOS and the config names
    bos_token without add_bos_token; documents start with BOS as transformers' tokenizer starts them,
    and a prompt's ids (encode) carry none."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import processors

    folder = _bare_bpe(tmp_path / "llama3ish", ["<|begin_of_text|>", "<|end_of_text|>"])
    rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    rust.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                        special_tokens=[("<|begin_of_text|>", 0)])
    rust.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 1, True)
    ids = encode(tok, TEXT)
    assert ids[0] != 0 and document_ids(tok, ids).tolist() == [0, *ids.tolist(), 1]
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))  # said: kept
    assert not load_tokenizer(str(folder)).add_bos


@pytest.mark.parametrize("config, message", [
    ({"eos_token": "<|eot_id|>"}, 'eos_token "<|eot_id|>" is no token of'),
    ({"eos_token": 12345}, "eos_token must be a token (a string), not 12345"),
    ({"bos_token": {"content": "<bos>", "special": True}}, 'bos_token "<bos>" is no token of'),
    ({"pad_token": ["<pad>"]}, 'pad_token must be a token (a string), not ["<pad>"]'),
])
def test_a_config_naming_no_token_is_one_line(bpe, tmp_path, config, message):
    """eos_token naming no token was a silent None (documents without an end), 12345 a TypeError."""
    folder = tmp_path / "tok"
    bpe.save(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ShardError) as e:
        load_tokenizer(str(folder))
    assert str(e.value).startswith(f"{folder / 'tokenizer_config.json'}: ") and "\n" not in str(e.value)
    assert message in str(e.value)


def test_a_long_text_is_encoded_in_pieces_with_the_ids_of_the_whole(bpe, sentencepiece_model, monkeypatch,
                                                                     tmp_path):
    """One 50 MB JSONL line took 6 GB to encode whole (and 4.4 GB to train a tokenizer on); it is encoded in
    pieces of PIECE_CHARS (small here) cut where the ids stay those of the whole, and a text with no such
    place is refused, not encoded whole."""
    import random

    from shard.data import tokenizers

    rnd = random.Random(0)
    words = ["café", "wörld", "  ", "\n\n", "日本語", "x", "   def", "\t", "!!", "'s", "123456", "<|endoftext|>", " ", "\n"]
    text = "\n".join(_lines(300)) + "".join(rnd.choice(words) for _ in range(3000))
    sp = load_tokenizer(str(sentencepiece_model))
    whole = [bpe._encode([text])[0], np.asarray(sp._sp.Encode(text), np.int32)]
    trained_whole = train_bpe([text], 300, tmp_path / "whole").path.read_text()
    monkeypatch.setattr(tokenizers, "PIECE_CHARS", 200)
    monkeypatch.setattr(tokenizers, "MAX_PIECE_CHARS", 1600)
    monkeypatch.setattr(tokenizers, "_CUT_WINDOW", 64)
    assert len(tokenizers._cuts(bpe._encode, text)) > 50
    # a tokenizer trained on the text in pieces (its words counted a piece at a time) is the same one
    assert train_bpe([text], 300, tmp_path / "pieces").path.read_text() == trained_whole
    for tok, ids in zip((bpe, sp), whole):
        short, cut = tok.encode_batch(["a b", text])
        assert cut.tolist() == ids.tolist() and short.tolist() == tok.encode_batch(["a b"])[0].tolist()
    with pytest.raises(ShardError, match="a text of 2,000 characters has no place to cut it between characters "
                                         "200 and 1,600"):
        bpe.encode_batch(["x" * 2000])
    # a BPE without a pre-tokenizer merges across spaces ("hello world" is one token): a cut there would change
    # the ids, and is passed over for one that does not
    tok = tokenizers.HuggingFaceTokenizer(_bpe_without_pre_tokenizer(tmp_path))
    text = "he " + "hello world " * 100  # the first space past PIECE_CHARS is inside "hello world"
    assert tok.decode(tok._encode(["hello world"])[0]) == "hello world" and len(tok._encode(["hello world"])[0]) == 1
    assert tok.encode_batch([text])[0].tolist() == tok._encode([text])[0].tolist()


def _bpe_without_pre_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, trainers

    rust = RustTokenizer(models.BPE())
    rust.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=40, show_progress=False))
    rust.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
