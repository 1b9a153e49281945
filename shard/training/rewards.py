"""GRPO's rewards: functions `(prompt_row, completion_text) -> float`, several summed with weights
(`grpo.rewards`: "NAME" or "NAME=WEIGHT" each).

NAME is a built-in verifiable reward, or `module:function` (`path/to/file.py:function`) of the user's own.
The built-ins compare a final answer extracted from the completion with the row's `answer` field (as
GSM8K writes it, `... #### 72`, or plain): `answer` (after `####`), `boxed` (the last `\\boxed{...}`),
`last_number`; `format` is 1 where the completion matches `grpo.format_pattern` (re.search), else 0.
A reward that raises or returns anything but a finite number stops the run with one line naming the row.
"""

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.config.finetune import reward_spec
from shard.errors import ShardError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def hash_answer(text: str) -> str | None:
    """The text after the last `####` on its line (GSM8K's final answer); None without one."""
    found = re.findall(r"####[ \t]*([^\n]*)", text)
    return found[-1].strip() if found else None


def boxed_answer(text: str) -> str | None:
    """The contents of the last `\\boxed{...}`, braces inside it balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, at = 0, start + len("\\boxed{")
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[at:i].strip()
    return None  # never closed


def last_number(text: str) -> str | None:
    """The last number in the text (thousands commas allowed); None without one."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def same_answer(got: str | None, want) -> bool:
    """Whether an extracted answer is the expected one: as numbers where both read as numbers (1,000 and
    1000.0 agree), else as text, each stripped of spaces, `$` and a final period."""
    if got is None:
        return False
    a, b = (str(x).strip().strip("$").rstrip(".").replace(",", "").strip() for x in (got, want))
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return a == b


def _answer_reward(extract: Callable[[str], str | None]):
    def reward(row: dict, text: str) -> float:
        if "answer" not in row:
            raise ShardError("the row has no 'answer' field, which this reward compares with")
        want = row["answer"]
        want = (hash_answer(want) or want) if isinstance(want, str) else want  # GSM8K: the solution, then ####
        return float(same_answer(extract(text), want))
    return reward


BUILTIN = {"answer": _answer_reward(hash_answer), "boxed": _answer_reward(boxed_answer),
           "last_number": _answer_reward(last_number)}


@dataclass(frozen=True)
class Reward:
    name: str
    weight: float
    fn: Callable[[dict, str], float]


def load_rewards(specs: tuple[str, ...], format_pattern: str = "") -> list[Reward]:
    """The rewards `grpo.rewards` names, each imported now: a missing module or function is one line."""
    if not specs:
        raise ShardError("task grpo needs a reward: --reward answer | boxed | last_number | format | module:function")
    out = []
    for spec in specs:
        name, weight = reward_spec(spec)
        if name == "format":
            out.append(Reward(name, weight, _format_reward(format_pattern)))
        elif name in BUILTIN:
            out.append(Reward(name, weight, BUILTIN[name]))
        elif ":" in name:
            out.append(Reward(name, weight, _user_function(name)))
        else:
            raise ShardError(f"reward {name!r} is none of {', '.join([*BUILTIN, 'format'])} nor module:function")
    return out


def _format_reward(pattern: str):
    if not pattern:
        raise ShardError("reward format needs grpo.format_pattern (a regular expression a completion should match)")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ShardError(f"grpo.format_pattern {pattern!r} is no regular expression: {e}") from None
    return lambda row, text: float(compiled.search(text) is not None)


def _user_function(name: str):
    """`module:function` imported (the working directory first on the path), or `file.py:function` loaded."""
    module_name, _, function = name.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or not Path(module_name).is_file():
                raise ShardError(f"reward {name}: no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ShardError:
        raise
    except ModuleNotFoundError as e:
        raise ShardError(f"reward {name}: no module {e.name!r} to import") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything as it imports
        raise ShardError(f"reward {name}: importing {module_name} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ShardError(f"reward {name}: {module_name} has no function {function!r}")
    return fn


def score(rewards: list[Reward], rows: list[tuple[int, dict]], texts: list[str], where: str) -> np.ndarray:
    """(completions, rewards) float32: each reward of each completion; `rows[i]` (its line in `where`, the
    prompt row) is completion i's prompt. A reward that raises or returns no finite number is one line."""
    out = np.zeros((len(texts), len(rewards)), np.float32)
    for i, ((line, row), text) in enumerate(zip(rows, texts)):
        for j, r in enumerate(rewards):
            try:
                value = r.fn(row, text)
            except ShardError as e:
                raise ShardError(f"{where} line {line}: reward {r.name}: {e}") from None
            except Exception as e:  # noqa: BLE001 - a user's reward may raise anything
                raise ShardError(f"{where} line {line}: reward {r.name} raised {type(e).__name__}: {e}") from None
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ShardError(f"{where} line {line}: reward {r.name} returned {value!r:.40}, not a finite number")
            out[i, j] = value
    return out


def total(rewards: list[Reward], scores: np.ndarray) -> np.ndarray:
    """(completions,) the weighted sum of each completion's rewards."""
    return scores @ np.asarray([r.weight for r in rewards], np.float32)


def per_reward_stats(rewards: list[Reward], scores: np.ndarray) -> dict[str, float]:
    """Each reward's mean and standard deviation over the completions (`reward/NAME`, `reward_std/NAME`),
    unweighted; the deviation over the whole batch (ddof 0), as `reward_std` is the weighted sum's."""
    out = {}
    for r, column in zip(rewards, scores.T):
        out[f"reward/{r.name}"], out[f"reward_std/{r.name}"] = float(column.mean()), float(column.std())
    return out
