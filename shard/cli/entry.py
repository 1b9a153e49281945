"""The `shard` command's entry point: the huge-page restart (shard.startup.host_memory) comes before the CLI's
imports (typer, rich: 0.14 s), which a restart would otherwise pay twice."""

from shard.startup import host_memory


def main() -> None:
    host_memory.reexec_with_huge_pages()
    from shard.cli.app import main as cli_main

    cli_main()
