"""orbax set up once for shard's checkpoints: the array writer's threshold, and orbax's noise kept out of
the log (tracebacks of errors shard reports in one line, notes on what shard chose on purpose)."""

import contextlib
import functools
import logging
import os
import sys

import jax
import orbax.checkpoint as ocp

# orbax splits the writing of a replicated array between its replicas, slicing each shard with a small
# jitted program that compiles once per shape and device: 56 compiles (3 s) at the first save of even the
# tiny model on 8 CPU devices. Worth it only for big arrays, so smaller ones are written by one replica.
MIN_BYTES_FOR_REPLICA_PARALLEL_WRITES = 16 << 20


@functools.cache
def configure_orbax() -> None:
    """Once per process, before orbax writes or reads: its array writer with the threshold above, and
    the filters below on what it logs."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    handler = ocp.type_handlers.ArrayHandler(  # orbax's default, but for the threshold
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_BYTES_FOR_REPLICA_PARALLEL_WRITES)
    _drop_closed_loop_callbacks()
    for name in ("absl", "asyncio"):
        if _orbax_noise not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_orbax_noise)
    with absl_quiet():  # not the "overriding jax.Array" warning
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


@contextlib.contextmanager
def absl_quiet():
    """orbax's absl warnings, which say what shard chose, left out for the block."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"  # in the path of orbax's own files


def _orbax_noise(record: logging.LogRecord) -> bool:
    """False (dropped) for orbax's logged errors with a traceback: a failed background save (a full
    disk) logs one per thread involved, and the same exception reaches the caller at the next wait,
    where the CLI reports it in one line. Also asyncio's "Task exception was never retrieved" for an
    orbax write task that failed beside the one reported (logged when the task is collected, after the
    error line). And orbax's notes on reading a damaged checkpoint (_ORBAX_READ_NOTES)."""
    if record.name == "asyncio":
        message = record.getMessage()
        return not (message.startswith("Task exception was never retrieved") and _ORBAX_SOURCE in message)
    if _ORBAX_SOURCE not in record.pathname:
        return True
    return not (record.exc_info or record.getMessage().startswith(_ORBAX_READ_NOTES))


# What orbax logs on reading a damaged checkpoint (or a folder that is none), before the error that shard
# reports in one line with the path and what is wrong: dropped, so that line is all that is printed.
_ORBAX_READ_NOTES = ('Item "', "Metadata file does not exist", "Failed to read Metadata file",
                     "Failed to json parse Metadata file")


def _drop_closed_loop_callbacks() -> None:
    """When one read of a restore fails, orbax closes its asyncio loop while tensorstore's other reads
    are still in flight; each then reports "Event loop is closed", or its own read error from a
    coroutine that is never awaited, as an unraisable exception: a traceback apiece (with the whole
    TensorStore spec) after the one-line notice. Those, and only those, are dropped."""
    previous = sys.unraisablehook

    def hook(args) -> None:
        closed_loop = args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"
        code = getattr(getattr(args, "object", None), "cr_code", None)  # a coroutine's
        orbax_read = code is not None and _ORBAX_SOURCE in code.co_filename
        if not (closed_loop or orbax_read):
            previous(args)

    sys.unraisablehook = hook
