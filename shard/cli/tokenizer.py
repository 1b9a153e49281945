"""`shard tokenizer ...`: train a byte-level BPE tokenizer on the user's text."""

import typer

tokenizer_app = typer.Typer(no_args_is_help=True, help="Tokenizers: train one on your text.")
