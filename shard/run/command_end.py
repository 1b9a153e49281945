"""How a command's process ends, for the command line: an error of its own reaches the other processes of
its job, and the cluster one command expected is not the next one's. Thin over shard.cluster.runtime,
which is asked only where a command loaded it (a command that never started JAX has no cluster)."""

import sys

_RUNTIME = "shard.cluster.runtime"


def wait_if_stopping() -> None:
    """If another thread is stopping this process (a lost peer), wait for its exit: an error here is a
    consequence of that, not news."""
    if runtime := sys.modules.get(_RUNTIME):
        runtime.wait_if_stopping()


def leave_on_error(message: str, code: int) -> None:
    """This process stops on an error of its own: with several processes the others learn of it (or the
    job stops) and this one exits with `code`; one process returns, and the caller exits."""
    from shard.cluster.runtime import leave_on_error as leave

    leave(message, code)


def forget_expected_cluster() -> None:
    """The cluster a command expected to join is not the next in-process command's."""
    if runtime := sys.modules.get(_RUNTIME):
        runtime.expect(None)
