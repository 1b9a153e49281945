"""Start-up time: keep optional packages that a dependency probes for out of shard's processes.

tensorboardX imports torch (4 s) only to accept torch tensors, and flax imports IPython (0.5 s) only to
ask whether it runs in a notebook; shard needs neither from them. Inside `without(...)` such a probe
sees the package as not installed. A package already imported (a notebook's IPython, a user's torch)
is left alone, so this never changes what a running program has.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def without(*names: str):
    """Imports inside the block raise ImportError for `names` (those not imported yet)."""
    hidden = [n for n in names if n not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's marker for "import raises ImportError"
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def import_flax() -> None:
    """Import flax (NNX) without its IPython probe."""
    with without("IPython"):
        import flax.nnx  # noqa: F401
