"""Child processes that end with the process that started them: a killed `shard launch` leaves no workers
training on, a killed `shard data prepare` no workers writing into its partial store."""

import contextlib
import os
import signal
import sys


def die_with_parent(parent: int) -> None:
    """In a child (a `preexec_fn`, a pool's initializer): SIGTERM it when its parent dies (Linux's
    PR_SET_PDEATHSIG), and at once if `parent` (the pid that started it) is gone already, which the
    kernel's mark comes too late for. Elsewhere nothing happens."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
