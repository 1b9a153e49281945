"""`python -m shard ARGS` that kills itself (SIGKILL) at the moment its first checkpoint save is written
and about to be renamed into place: what a kill -9 during an async save leaves, without a timing race
(used by tests/test_checkpoint.py).

    python killed_in_save.py train --run-dir ...
"""

import os
import runpy
import signal
import sys

from orbax.checkpoint._src.path import atomicity


def killed(self):
    os.kill(os.getpid(), signal.SIGKILL)


for kind in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    kind.finalize = killed

sys.argv = ["shard", *sys.argv[1:]]
runpy.run_module("shard", run_name="__main__", alter_sys=True)
