"""Chat data for fine-tuning: conversations rendered with the tokenizer's chat template, and which of
their tokens are trained on.

A conversation is a JSON Lines row `{"messages": [{"role": ..., "content": ...}, ...]}`. It is rendered
with the `chat_template` of the tokenizer's `tokenizer_config.json` (or `chat_template.jinja` beside it)
through transformers' own Jinja machinery, within a time and an output-size bound (shard.data.templates),
or with `DEFAULT_CHAT_TEMPLATE` (ChatML) when the tokenizer has none. The text of an assistant turn is what rendering the conversation up to that turn adds to the
rendering of the turns before it with `add_generation_prompt` (the prompt a model sees when it answers).
The rendering is cut at those points and each piece tokenized on its own, so an assistant turn's
tokens are exactly the ones a model generates after its prompt; only they are trained on.

A GRPO prompt is a row `{"prompt": ...}` or `{"messages": [...]}`, plus any fields its rewards read
(`answer` ...): a `prompt` string is the text a model continues, as is (TRL's "standard" form, for a base
model); messages are rendered with `add_generation_prompt`, as SFT renders the prompt of an assistant turn.

A preference pair (DPO) is a row `{"prompt", "chosen", "rejected"}`: each a string (a user turn, an
assistant turn), or a list of messages; the completion's assistant turns are the trained tokens.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.data.files import BadRow, json_row
from shard.data.templates import TemplateBound, render
from shard.data.tokenizers import Tokenizer, lone_surrogate, read_json_object
from shard.errors import ShardError

# ChatML, for a tokenizer without a chat template of its own (the byte tokenizer, a bare tokenizer.json).
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATE_FILE = "chat_template.jinja"
ASSISTANT = "assistant"


def chat_template(tokenizer: Tokenizer) -> str:
    """The tokenizer's chat template: tokenizer_config.json's `chat_template` (a string, or the one named
    "default" of a list), else a chat_template.jinja beside it, else DEFAULT_CHAT_TEMPLATE. A
    `chat_template` of another kind is an error, not a silent ChatML."""
    config_path = getattr(tokenizer, "config_path", None)
    if config_path is not None:
        if config_path.is_file():
            found = read_json_object(config_path).get("chat_template")
            if isinstance(found, list):  # [{"name": "default", "template": ...}, ...]
                found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"),
                             found)
            if isinstance(found, str) and found:
                return found
            if found not in (None, ""):
                raise ShardError(f"{config_path}: chat_template must be a template (a string), or a list of "
                                 f"{{name, template}} with one named \"default\", got {_kind(found)}")
        jinja = config_path.with_name(TEMPLATE_FILE)
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
    return DEFAULT_CHAT_TEMPLATE


def _kind(value) -> str:
    if isinstance(value, list):
        return "a list without a string template named \"default\""
    return f"{type(value).__name__} {json.dumps(value)[:40]}"


def _template_tokens(tokenizer: Tokenizer) -> dict:
    """The special tokens a template may name (bos_token, eos_token ...), as transformers passes them."""
    config_path = getattr(tokenizer, "config_path", None)
    config = read_json_object(config_path) if config_path is not None and Path(config_path).is_file() else {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


@dataclass(frozen=True)
class ChatRenderer:
    """Renders conversations with one template into token ids and per-token trained flags."""

    tokenizer: Tokenizer
    template: str
    where: str  # the data file, for messages

    @classmethod
    def of(cls, tokenizer: Tokenizer, where: str) -> "ChatRenderer":
        return cls(tokenizer, chat_template(tokenizer), where)

    def _render(self, messages: list[dict], line: int, generation_prompt: bool) -> str:
        try:  # transformers' sandbox, within a time and an output-size bound (shard.data.templates)
            return render(self.template, messages=messages, tools=None, documents=None,
                          add_generation_prompt=generation_prompt, **_template_tokens(self.tokenizer))
        except TemplateBound as e:
            raise ShardError(f"{self.where} line {line}: the chat template {e} rendering this conversation "
                             "(docs/finetuning.md)") from None
        except Exception as e:  # noqa: BLE001 - Jinja raises many kinds; each is the template's failure
            detail = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise ShardError(f"{self.where} line {line}: the chat template failed to render this conversation "
                             f"({type(e).__name__}: {detail})") from None

    def prompt(self, messages: list[dict], line: int = 1) -> str:
        """The text a model answers the conversation from (rendered with add_generation_prompt)."""
        return self._render(messages, line, True)

    def pieces(self, messages: list[dict], line: int, trained_from: int = 0) -> list[tuple[str, bool]]:
        """The conversation's rendering cut into (text, trained) pieces: the assistant turns at or after
        message `trained_from` trained, the rest not."""
        full = self._render(messages, line, False)
        pieces, at = [], 0
        for i, m in enumerate(messages):
            if m["role"] != ASSISTANT or i < trained_from:
                continue
            prompt_text = self._render(messages[:i], line, True)
            end_text = self._render(messages[:i + 1], line, False)
            if not (full.startswith(end_text) and end_text.startswith(prompt_text) and len(prompt_text) >= at):
                raise ShardError(f"{self.where} line {line}: the chat template does not render this conversation's "
                                 f"turns as prefixes of the whole (message {i + 1}), so its assistant tokens "
                                 "can't be told apart; use a template that renders turns in order")
            start = len(prompt_text)
            pieces += [(full[at:start], False), (full[start:len(end_text)], True)]
            at = len(end_text)
        pieces.append((full[at:], False))
        return [(text, trained) for text, trained in pieces if text]

    def encode(self, messages: list[dict], line: int, trained_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, trained flags as int8) of one conversation; each piece tokenized on its own."""
        pieces = self.pieces(messages, line, trained_from)
        ids = self.tokenizer.encode_batch([text for text, _ in pieces])
        flags = [np.full(len(i), trained, np.int8) for i, (_, trained) in zip(ids, pieces)]
        return np.concatenate(ids).astype(np.int32), np.concatenate(flags)


def read_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, row) of every non-blank line of a JSON Lines file; one line naming a bad row."""
    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        raise ShardError(f"fine-tuning data {path} must be a JSON Lines file (.jsonl), one row per line")
    rows = []
    for n, text in enumerate(p.read_bytes().splitlines(), 1):  # bytes: U+2028 in a string ends no line
        if not text.strip():
            continue
        try:
            row = json_row(text)
        except BadRow as e:
            raise ShardError(f"{path} line {n} {e}") from None
        if not isinstance(row, dict):
            raise ShardError(f"{path} line {n} is not a JSON object")
        rows.append((n, row))
    if not rows:
        raise ShardError(f"{path} holds no rows")
    return rows


def messages_of(value, where: str, line: int, field: str, default_role: str) -> list[dict]:
    """A list of {role, content} messages; a plain string is one message of `default_role`."""
    if isinstance(value, str):
        value = [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ShardError(f"{where} line {line}: {field!r} must be a string or a non-empty list of messages")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ShardError(f"{where} line {line}: every message of {field!r} needs a string 'role' and 'content', "
                             f"got {json.dumps(m)[:80]}")
        for key in ("role", "content"):
            if problem := lone_surrogate(m[key]):
                raise ShardError(f"{where} line {line}: a message's {key!r} in {field!r} holds {problem}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_chats(path: str, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, trained flags, document ends) of a file of conversations, each one a document."""
    render = ChatRenderer.of(tokenizer, path)
    ids, flags = [], []
    for n, row in read_rows(path):
        if "messages" not in row:
            raise ShardError(f"{path} line {n} has no 'messages' (a list of {{role, content}})")
        messages = messages_of(row["messages"], path, n, "messages", "user")
        if not any(m["role"] == ASSISTANT for m in messages):
            raise ShardError(f"{path} line {n}: a conversation without an assistant turn, so nothing to train on")
        i, f = render.encode(messages, n)
        ids.append(i)
        flags.append(f)
    return np.concatenate(ids), np.concatenate(flags), np.cumsum([len(i) for i in ids]).astype(np.int64)


PAIR_FIELDS = ("prompt", "chosen", "rejected")


def read_pairs(path: str, tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(chosen ids, chosen flags, rejected ids, rejected flags) of every preference pair."""
    render = ChatRenderer.of(tokenizer, path)
    pairs = []
    for n, row in read_rows(path):
        missing = [f for f in PAIR_FIELDS if f not in row]
        if missing:
            raise ShardError(f"{path} line {n} has no {', '.join(repr(f) for f in missing)} (a preference pair needs "
                             "prompt, chosen and rejected)")
        prompt = messages_of(row["prompt"], path, n, "prompt", "user")
        both = []
        for field in ("chosen", "rejected"):
            completion = messages_of(row[field], path, n, field, ASSISTANT)
            if not any(m["role"] == ASSISTANT for m in completion):
                raise ShardError(f"{path} line {n}: {field!r} holds no assistant turn, so nothing to compare")
            both += render.encode(prompt + completion, n, trained_from=len(prompt))
        pairs.append(tuple(both))
    return pairs


@dataclass(frozen=True)
class Prompt:
    """A GRPO prompt: its line in the file, its row (what rewards read) and its rendered token ids."""

    line: int
    row: dict
    ids: np.ndarray


def read_prompts(path: str, tokenizer: Tokenizer, max_tokens: int) -> list[Prompt]:
    """Every prompt of a JSON Lines file: a `prompt` string as is, messages (`prompt` or `messages`) rendered;
    a prompt longer than `max_tokens` (the room --seq leaves for a completion) is an error naming its line."""
    render = ChatRenderer.of(tokenizer, path)
    prompts = []
    for n, row in read_rows(path):
        field = next((f for f in ("prompt", "messages") if f in row), None)
        if field is None:
            raise ShardError(f"{path} line {n} has no 'prompt' (a string or a list of {{role, content}}) "
                             "nor 'messages'")
        text = row[field] if isinstance(row[field], str) and field == "prompt" else render.prompt(
            messages_of(row[field], path, n, field, "user"), n)
        ids = np.asarray(tokenizer.encode_batch([text])[0], np.int32)
        if not len(ids):
            raise ShardError(f"{path} line {n}: its prompt renders to no tokens")
        if len(ids) > max_tokens:
            raise ShardError(f"{path} line {n}: its prompt is {len(ids)} tokens, more than the {max_tokens} that "
                             "--seq leaves beside grpo.max_new_tokens; raise --seq or shorten it")
        prompts.append(Prompt(n, row, ids))
    return prompts
