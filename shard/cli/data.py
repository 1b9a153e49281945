"""`shard data ...`: prepare sources into a memory-mapped token store."""

import time
from pathlib import Path
from typing import Annotated

import typer

from shard.observe.console import console

data_app = typer.Typer(no_args_is_help=True, help="Data: tokenize sources once into a token store.")


@data_app.command("prepare")
def prepare(
    sources: Annotated[list[str], typer.Argument(help="files, folders or globs (data/*.jsonl): text, .jsonl, "
                                                      ".parquet, .arrow or a saved Hugging Face dataset")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="'byte', a tokenizer.json, a SentencePiece "
                                                               ".model or a folder holding one")],
    out: Annotated[Path, typer.Option("--out", help="the token store's new folder")],
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="processes (default: every core)")] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="the text's key (JSONL) or column")] = "text",
):
    """Tokenize SOURCES once into a token store that training memory-maps (docs/data.md).

    A run that stops leaves OUT.partial; the same command continues it."""
    from shard.data.store import prepare_store

    start = time.perf_counter()
    store = prepare_store(sources, tokenizer, out, text_field=text_field, workers=workers)
    secs = time.perf_counter() - start
    console.print(f"{store.n_documents:,} documents, {store.n_tokens:,} tokens in {len(store.meta['shards'])} "
                  f"shard(s) ({store.n_tokens / secs:,.0f} tokens/s) in {out}", soft_wrap=True)
