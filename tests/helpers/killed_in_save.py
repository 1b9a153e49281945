"""`python -m shard ARGS` that kills itself (SIGKILL) at the moment a checkpoint save is written and about
to be renamed into place: what a kill -9 during an async save leaves, without a timing race (used by
tests/test_checkpoint.py). The save is the first one, or with SHARD_TEST_KILL_AT set the first whose
final path matches that regular expression (`snapshot.*/6$`: the local snapshot of step 6).

    python killed_in_save.py train --run-dir ...
"""

import os
import re
import runpy
import signal
import sys

from orbax.checkpoint._src.path import atomicity

KILL_AT = os.environ.get("SHARD_TEST_KILL_AT")

for kind in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    def finalize(self, *args, _finalize=kind.finalize, **kwargs):
        if KILL_AT is None or re.search(KILL_AT, str(self.get_final())):
            os.kill(os.getpid(), signal.SIGKILL)
        return _finalize(self, *args, **kwargs)

    kind.finalize = finalize

sys.argv = ["shard", *sys.argv[1:]]
runpy.run_module("shard", run_name="__main__", alter_sys=True)
