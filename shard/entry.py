"""The `shard` command's entry point: the huge-page restart (shard.host_memory) comes before the CLI's
imports (typer, rich: 0.14 s), which a restart would otherwise pay twice."""

from shard import host_memory


def main() -> None:
    host_memory.reexec_with_huge_pages()
    from shard.cli import main as cli_main

    cli_main()
