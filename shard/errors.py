"""The one exception users can cause: the CLI turns it into a one-line message and exit code 2."""


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
