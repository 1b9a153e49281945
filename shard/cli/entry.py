"""The `shard` command's entry point: the huge-page restart (shard.startup.host_memory) comes before the CLI's
imports (typer, rich: 0.14 s), which a restart would otherwise pay twice."""

import os
import sys

from shard.startup import host_memory


def main() -> None:
    host_memory.reexec_with_huge_pages()
    _no_ipython()
    from shard.cli.app import main as cli_main

    cli_main()


def _no_ipython() -> None:
    """A command is never run inside an IPython shell, but flax asks IPython whether it may colour its
    reprs when it is imported, which loads all of IPython where it is installed (the notebooks extra):
    0.35 s of CPU in every shard process, a tenth of a short run's. Mark it absent in this process, unless
    a debugger that needs it is asked for (PYTHONBREAKPOINT=ipdb.set_trace)."""
    if "IPython" not in sys.modules and not os.environ.get("PYTHONBREAKPOINT"):
        sys.modules["IPython"] = None  # `import IPython` raises ImportError, as where it is not installed
