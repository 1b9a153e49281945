"""`shard generate`: sample from a checkpoint's model on a mesh, streaming the tokens."""

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shard.cli.options import CheckpointOpt, SimOpt, WeightsArg, check_rules_only, checkpoint_given, warn
from shard.config.model import cache_line
from shard.errors import ShardError
from shard.observe.console import err_console


def generate(
    checkpoint: WeightsArg = None,
    checkpoint_opt: CheckpointOpt = None,
    prompt: Annotated[str | None, typer.Option(help="prompt text (tokenized with the model's tokenizer)")] = None,
    prompt_ids: Annotated[str | None, typer.Option("--prompt-ids", help="prompt as token ids: 5,17,99")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file", help="one prompt per line")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0: off")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="1: off")] = 1.0,
    seed: int = 0,
    mesh: Annotated[str, typer.Option(help="mesh to generate on (tensor parallel: 1x4, ...)")] = "1x1",
    ids: Annotated[bool, typer.Option("--ids", help="print generated token ids instead of text")] = False,
    simulate_devices: SimOpt = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a sharding rule: --set rules.kv_heads=none")] = None,
):
    """Sample from a model with a KV cache on a mesh, streaming tokens as they come."""
    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    check_rules_only(set_, "generate")
    given = [x for x in (prompt, prompt_ids, prompts_file) if x is not None]
    if len(given) != 1:
        raise ShardError("give exactly one of --prompt, --prompt-ids or --prompts-file")
    if not 0 <= max_new_tokens < 2**31:
        raise ShardError(f"--max-new-tokens must be 0 or more and below 2**31, got {max_new_tokens}")
    if not 0 <= seed < 2**32:  # as train's
        raise ShardError(f"--seed must be between 0 and 2**32-1, got {seed}")
    texts = _prompt_texts(prompt, prompts_file) if prompt_ids is None else []
    from shard.run.inference import load_model, start_jax

    cfg, mesh_spec, devices = start_jax(mesh, simulate_devices, set_)
    from shard import Sampling

    (sampling := Sampling(temperature, top_k, top_p)).validate()  # before the weights are read
    loaded = load_model(checkpoint, cfg, mesh_spec, devices)
    prompts, lead, tokenizer = _prompts(loaded, texts, prompt_ids, ids)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    _warn_past_positions(checkpoint, max_len)
    if loaded.model.mla:  # the latent cache's size, beside full keys and values
        err_console.print(escape(cache_line(loaded.model, devices[0].platform)), highlight=False, soft_wrap=True)
    gen = loaded.generator(max_len)
    for n, p in enumerate(prompts):
        _stream(gen, p, max_new_tokens, sampling, seed + n, None if ids else tokenizer, len(lead))


def _prompts(loaded, texts: list[str], prompt_ids: str | None, ids: bool):
    """(the prompts as token ids, the unshown ids each starts with: a BOS its tokenizer adds, the tokenizer)."""
    from shard.data.tokenizers import encode

    vocab_size, tokenizer = loaded.model.vocab_size, loaded.tokenizer
    if tokenizer is None and not (ids and prompt_ids is not None):
        raise ShardError(f"this model has a {vocab_size}-token vocabulary and no tokenizer goes with it "
                         "(none in its run dir's tokenizer/ or hf/ folder): use --prompt-ids and --ids")
    lead = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    if prompt_ids is not None:
        return [_parse_ids(prompt_ids, vocab_size)], [], tokenizer
    return [lead + encode(tokenizer, t).tolist() for t in texts], lead, tokenizer


def _warn_past_positions(source: str, length: int) -> None:
    """Once, as `train --seq` does: sampling past the positions the weights were made for goes on
    in positions new to the model."""
    from shard.run.hf_side import positions_made_for

    limit = positions_made_for(source)
    if limit is not None and length > limit:
        warn(f"the prompt and --max-new-tokens reach position {length}, beyond the {limit} positions {source} "
             "was made for (max_position_embeddings in its config.json): the tokens past it come from positions "
             "new to the model")


def _stream(gen, prompt: list[int], max_new_tokens: int, sampling, seed: int, tokenizer, skip: int = 0) -> None:
    """One prompt's continuation printed token by token: ids (no `tokenizer`), or the prompt and the
    text as it decodes (the prompt's first `skip` ids, a BOS, not shown). A token that ends inside a
    character (bytes, byte-level BPE) waits for the next: the text is decoded whole each time, and
    what was not yet shown is printed once it no longer ends in U+FFFD."""
    shown = ""  # what is on the line so far
    if tokenizer is None:
        def emit(token: int) -> None:
            nonlocal shown
            shown = f"{token} "
            print(shown, end="", flush=True)
    else:
        ids = list(prompt[skip:])
        shown = tokenizer.decode(ids)
        print(shown, end="", flush=True)

        def emit(token: int) -> None:
            nonlocal shown
            ids.append(token)
            text = tokenizer.decode(ids)
            if not text.endswith("\ufffd") and len(text) > len(shown):
                print(text[len(shown):], end="", flush=True)
                shown = text
    try:
        gen.generate(prompt, max_new_tokens, sampling, seed=seed, on_token=emit)
    except BaseException:  # out of memory, Ctrl-C: the error line starts on a line of its own
        if shown:
            print(flush=True)
        raise
    rest = "" if tokenizer is None else tokenizer.decode(ids)[len(shown):]  # an unfinished character: U+FFFD
    print(rest, flush=True)


def _prompt_texts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompts to sample from: --prompt, or each line of --prompts-file (which must hold one)."""
    if prompt is not None:
        from shard.data.tokenizers import lone_surrogate
        if problem := lone_surrogate(prompt, argv=True):  # the shell's argument held bytes that are not UTF-8
            raise ShardError(f"--prompt holds {problem}")
        return [prompt]
    if not prompts_file.is_file():
        raise ShardError(f"prompts file {prompts_file} not found" if not prompts_file.exists()
                         else f"prompts file {prompts_file} is not a file")
    try:
        text = prompts_file.read_text()
        # lines end at a newline only (str.splitlines also splits at a form feed, which is text here)
        lines = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]
    except UnicodeDecodeError:
        raise ShardError(f"prompts file {prompts_file} is not UTF-8 text") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ShardError(f"prompts file {prompts_file} holds no prompt (one per line)")
    if len(prompts) < len(lines):
        err_console.print(f"[dim]skipping {len(lines) - len(prompts)} blank line(s) of {escape(str(prompts_file))}[/dim]")
    return prompts


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids: comma-separated token ids, each in the model's vocabulary."""
    parts = [t.strip() for t in text.strip().removesuffix(",").split(",")]
    if not all(p.lstrip("-").isdigit() for p in parts):
        raise ShardError(f"--prompt-ids expects comma-separated integers like 5,17,99, got {text!r}")
    ids = [int(p) for p in parts]
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise ShardError(f"--prompt-ids: token id {bad[0]} is outside the model's vocabulary 0..{vocab_size - 1}")
    return ids
