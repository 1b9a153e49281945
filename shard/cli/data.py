"""`shard data ...`: prepare sources into a memory-mapped token store."""

import typer

data_app = typer.Typer(no_args_is_help=True, help="Data: tokenize sources once into a token store.")
