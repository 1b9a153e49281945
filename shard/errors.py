"""The one exception users can cause, and which other errors count as theirs (`user_error`): the CLI turns
them into a one-line message and exit code 2."""

import os
import re


class ShardError(Exception):
    """A mistake in the user's input (mesh, config, data, rules), reported in one line."""


class DivergenceError(ShardError):
    """The loss or gradient norm went non-finite or spiked; the run stops before saving anything."""


def first_line(e: BaseException) -> str:
    """The first line of an error's message, or its type's name when the message is empty."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def out_of_memory(e: BaseException) -> bool:
    """Device or host memory ran out: XLA's RESOURCE_EXHAUSTED (or an "Out of memory" first line), or
    Python's MemoryError."""
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in first_line(e)


# What to change when a command runs out of device memory.
_OUT_OF_MEMORY_ADVICE = {"train": "to train, lower --batch or --seq, or set model.remat=full",
                         "generate": "give fewer or shorter prompts, or lower --max-new-tokens",
                         "inspect": "lower --batch or --seq", "eval": "lower --batch or --seq"}


def user_error(e: BaseException, command: str | None = "train") -> ShardError | None:
    """The one-line error for an exception the user's input or machine causes rather than a bug in
    shard: a ShardError, a file system error (a file where a folder belongs, no permission, disk full,
    also when tensorstore reports it), or running out of device memory. None for anything else, which
    keeps its traceback."""
    if isinstance(e, ShardError):
        return e
    if isinstance(e, OSError) and not isinstance(e, BrokenPipeError | ConnectionError | TimeoutError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
        return ShardError(f"{where}: {e.strerror or e}" if where else f"{type(e).__name__}: {e}")
    first = first_line(e)
    if "os_error_code=" in str(e):  # tensorstore's file errors (checkpoints)
        return ShardError(_tensorstore_file_error(str(e)))
    if out_of_memory(e):
        advice = _OUT_OF_MEMORY_ADVICE.get(command or "")
        return ShardError(f"out of memory ({first[:160]})" + (f"; {advice}" if advice else ""))
    if isinstance(e, RuntimeError) and "Unable to initialize backend" in first:
        return ShardError(f"{first} (JAX_PLATFORMS is {os.environ.get('JAX_PLATFORMS', 'unset')!r})")
    return None


def _tensorstore_file_error(text: str) -> str:
    """`PATH: REASON` from tensorstore's file error: the OS's reason is the last `: ` part once the
    bracketed annotations (`[os_error_code='28']`, `[source locations='...']`, `[tensorstore_spec='{...}']`,
    kilobytes of JSON) are dropped; the path is the first local file it names."""
    bare = re.sub(r" \[[\w ]+=(?:'[^']*'|[^\]\s]*)\]", "", text.strip()).splitlines()[0]
    reason = bare.rsplit(": ", 1)[-1].strip()
    paths = re.findall(r'"(/[^"]*)"', bare)
    return f"{paths[0]}: {reason}" if paths else f"{reason} ({bare[:200]})"
