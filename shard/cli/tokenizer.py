"""`shard tokenizer ...`: train a byte-level BPE tokenizer on the user's text."""

import time
from pathlib import Path
from typing import Annotated

import typer

from shard.observe.console import console
from shard.paths import check_fresh_out, written_whole

tokenizer_app = typer.Typer(no_args_is_help=True, help="Tokenizers: train one on your text.")


@tokenizer_app.command("train")
def train(
    data: Annotated[list[str] | None, typer.Argument(help="files, folders or globs of documents (text, .jsonl, "
                                                          ".parquet, datasets); none: the embedded corpus")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="ids in all, the end-of-text token included")] = 8192,
    out: Annotated[Path, typer.Option("--out", help="new folder for tokenizer.json and tokenizer_config.json")] = ...,
    text_field: Annotated[str, typer.Option("--text-field", help="the text's key (JSONL) or column")] = "text",
):
    """Train a byte-level BPE (GPT-2's scheme) on DATA; transformers' AutoTokenizer loads the folder."""
    from shard.data.documents import iter_documents, plan_chunks
    from shard.data.tokenizers import train_bpe

    specs = data or [""]
    plan_chunks(specs, text_field)  # a bad source fails before any folder is made
    check_fresh_out(out)
    start = time.perf_counter()
    with written_whole(out) as folder:
        tok = train_bpe(iter_documents(specs, text_field), vocab_size, folder)
    console.print(f"trained a byte-level BPE of {tok.vocab_size:,} ids in {time.perf_counter() - start:.1f}s: "
                  f"{out}", soft_wrap=True)
