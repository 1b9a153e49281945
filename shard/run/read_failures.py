"""Why a checkpoint could not be read, agreed between the processes: the machine's fault (out of memory,
no permission), which leaves the checkpoint in place, or the checkpoint's, which sets it aside."""

import contextlib
import errno
import re

from shard.cluster import exchange, runtime
from shard.errors import first_line, out_of_memory


def error_line(e: BaseException) -> str:
    """`Type: first line`, to 200 characters. orbax wraps a failed array read in a generic Exception
    ("... See full TensorStore details: <bound method ..."): the error it wraps is named instead."""
    first = first_line(e)
    if " See full TensorStore details" in first and e.__cause__ is not None:
        return error_line(e.__cause__)
    return (f"{type(e).__name__}: {first}" if str(e).strip() else first)[:200]


# Reads that fail for the machine's sake, not the checkpoint's: every other checkpoint would fail the same
# way, so falling back would set good ones aside in turn. By errno, also as tensorstore's os_error_code.
_MACHINE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _causes(e: BaseException | None):
    """`e` and the errors it was raised from, outermost first."""
    while e is not None:
        yield e
        e = e.__cause__


def _machine_error(e: BaseException) -> bool:
    """Out of device or host memory, no permission, too many open files: somewhere in the cause chain."""
    def errnos(c: BaseException) -> set[int]:  # an OSError's, or tensorstore's os_error_code in the text
        if isinstance(c, OSError):
            return {c.errno}
        return {int(n) for n in re.findall(r"os_error_code=\D?(\d+)", str(c))}

    return any(out_of_memory(c) or errnos(c) & _MACHINE_ERRNOS for c in _causes(e))


MACHINE, BAD = "machine: ", "bad: "


def read_outcomes(step: int, error: BaseException | None, in_read: bool) -> list[str]:
    """Every process's outcome of reading checkpoint `step`: "" (read), "machine: why" (the machine's
    fault, _machine_error), "bad: why" (the checkpoint's), or "peer" (this process read its part, but
    another did not). A process whose orbax read (`in_read`) failed first meets the barrier that orbax
    holds the others in at the end of a restore (a device collective in orbax 0.12), so that they stop
    waiting (with a barrier-name mismatch: their "peer")."""
    if error is None:
        outcome = ""
    elif _peer_failed(error):
        outcome = "peer"
    else:
        outcome = (MACHINE if _machine_error(error) else BAD) + error_line(error)
        if in_read and runtime.context().mode == runtime.XLA:
            with contextlib.suppress(Exception):  # met by the others' barrier: a name mismatch, expected
                exchange.barrier(f"checkpoint_read_failed_{step}", device_collective=True)
    outcomes = exchange.gather_text(outcome)
    if any(outcomes) and not any(o.startswith((MACHINE, BAD)) for o in outcomes):  # no one says why
        return [MACHINE + "a barrier between the processes failed" for _ in outcomes]
    return outcomes


def _peer_failed(e: BaseException | None) -> bool:
    """The error a process gets in a cross-process barrier that another process met from elsewhere."""
    return any("sync_global_devices name mismatch" in str(c) for c in _causes(e))
