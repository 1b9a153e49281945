"""Hostile input gets one line, never a traceback, an abort or a hang: text that is no Unicode, rows nested
past the recursion limit, a vocabulary too large for the tokenizer library, a chat template that would
take the machine's memory or time; and the weights a user means (1e308 twice is two halves)."""

import json

import pytest
from typer.testing import CliRunner

from shard.cli.app import app
from shard.data import templates
from shard.data.chat import ChatRenderer, read_chats
from shard.data.documents import iter_documents
from shard.data.mixture import block_counts
from shard.data.tokenizers import ByteTokenizer, train_bpe
from shard.errors import ShardError

DEEP = '{"text": "a", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
SURROGATE = json.dumps({"text": "abc\ud800", "messages": [{"role": "user", "content": "hi\ud800"},
                                                         {"role": "assistant", "content": "yo"}]}) + "\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(["hello there, general"] * 8, 300, tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("case, message", [
    ("surrogate text", r"rows.jsonl line 2: field 'text' holds a lone UTF-16 surrogate \ud800, which is no Unicode "
                       "character (at character 3)"),
    ("surrogate chat", r"rows.jsonl line 2: a message's 'content' in 'messages' holds a lone UTF-16 surrogate \ud800"),
    ("deep text", "rows.jsonl line 2 is nested too deeply to read"),
    ("deep chat", "rows.jsonl line 2 is nested too deeply to read"),
    ("surrogate bpe", r"a text holds a lone UTF-16 surrogate \ud800"),
    ("surrogate bytes", r"a text holds a lone UTF-16 surrogate \ud800"),
    ("huge vocabulary", "--vocab-size 1,000,000,000,000 is too large: at most 1,048,576 ids"),
    ("prompt", "--prompt holds the byte 0xff, which is not UTF-8 (at character 3)"),
])
def test_hostile_input_is_one_line(tmp_path, bpe, case, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "fine", "messages": [{"role": "assistant", "content": "ok"}]}) + "\n" +
                    (DEEP if case.startswith("deep") else SURROGATE))
    calls = {"surrogate text": lambda: list(iter_documents([str(rows)])),
             "deep text": lambda: list(iter_documents([str(rows)])),
             "surrogate chat": lambda: read_chats(str(rows), ByteTokenizer()),
             "deep chat": lambda: read_chats(str(rows), ByteTokenizer()),
             "surrogate bpe": lambda: bpe.encode_batch(["fine", "abc\ud800"]),
             "surrogate bytes": lambda: ByteTokenizer().encode_batch(["abc\ud800"]),
             "huge vocabulary": lambda: train_bpe(["a b"], 10**12, tmp_path / "tok")}
    if case == "prompt":  # Python keeps the shell's byte 0xff, not UTF-8, as U+DCFF; no model is read before
        result = CliRunner().invoke(app, ["generate", str(tmp_path / "no-run"), "--prompt", "abc\udcff"])
        assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, result.output
        return
    with pytest.raises(ShardError) as e:
        calls[case]()
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "tok").exists()


def test_mixture_weights_are_relative_however_large():
    """1e308 twice summed to inf, and the block's counts came out of NaN (an IndexError)."""
    assert block_counts([1e308, 1e308]).tolist() == [512, 512]
    assert block_counts([1e308, 1e308 / 3]).tolist() == block_counts([3, 1]).tolist() == [768, 256]


@pytest.mark.parametrize("template, message", [
    ("{{ 'x' * 10**9 }}", "built a str of 1,000,000,000 items with '*', past its bound of 4,096"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "built a str of 8,192 items with '+'"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "built a text of 8,192 characters with '~'"),
    ("{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}", "took more than 0.5 s"),
    ("{% set r = range(10**5) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "took more than 0.5 s"),
    ("{% for i in range(10**5) %}{{ messages[0]['content'] }}{% endfor %}", "output more than 4,096 characters"),
])
def test_a_chat_template_renders_within_a_time_and_a_size_bound(monkeypatch, template, message):
    """`'x' * 10**9` reached 15 GB and nested range loops hung (the bounds are smaller here, for time)."""
    monkeypatch.setattr(templates, "RENDER_CHARS", 4096)
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.5)
    render = ChatRenderer(ByteTokenizer(), template, "chats.jsonl")
    with pytest.raises(ShardError) as e:
        render.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], 7)
    assert str(e.value).startswith(f"chats.jsonl line 7: the chat template {message}"), str(e.value)
