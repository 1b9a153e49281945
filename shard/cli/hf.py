"""`shard import-hf` and `shard export-hf`: Hugging Face folders to and from shard checkpoints
(shard.run.hf_convert)."""

from pathlib import Path
from typing import Annotated

import typer

from shard.cli.options import CheckpointArg, CheckpointOpt, checkpoint_given
from shard.observe.console import console, params_phrase


def import_hf(
    hf_dir: Annotated[Path, typer.Argument(
        help="a local Hugging Face Llama, Qwen2 or Qwen3 folder (config.json + *.safetensors)")],
    out: Annotated[Path, typer.Option("--out", help="run dir to create with the imported checkpoint")],
):
    """Import a Hugging Face model (any family shard builds) as a shard checkpoint of its weights, read tensor by
    tensor; fine-tune it with --init-from."""
    from shard.run.hf_convert import import_hf_folder

    model_cfg = import_hf_folder(hf_dir, out)
    console.print(f"imported {hf_dir} ({params_phrase(model_cfg, 'parameters')}) into {out}; "
                  f"fine-tune with: shard train --init-from {out} ...", soft_wrap=True)


def export_hf(
    out: Annotated[Path | None, typer.Option("--out", help="folder to write config.json and safetensors into")] = None,
    checkpoint: CheckpointArg = None,
    checkpoint_opt: CheckpointOpt = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="a LoRA checkpoint: fold its adapters into the base weights and write a plain model")] = False,
    lora_out: Annotated[Path | None, typer.Option(
        "--lora-out", help="a LoRA checkpoint: write its adapters here in PEFT's format")] = None,
):
    """Write a checkpoint's model as a Hugging Face folder that transformers loads (the family its features make);
    a LoRA checkpoint's adapters merged into it (--merge) or for peft (--lora-out)."""
    from shard.run.hf_convert import check_export, export_adapters, export_hf_folder

    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    check_export(checkpoint, out, merge, lora_out)
    if lora_out is not None:
        lora, base = export_adapters(checkpoint, lora_out)
        console.print(f"wrote {lora_out}/adapter_config.json and adapter_model.safetensors (rank {lora.rank}, "
                      f"{', '.join(lora.targets)}) over " + (f"{base}" if base else "no Hugging Face folder: "
                      "export the base with shard export-hf BASE --out DIR and load the adapters over it"),
                      soft_wrap=True)
    if out is not None:
        files, tokenizer = export_hf_folder(checkpoint, out)
        console.print(f"wrote {out}/config.json and {len(files)} safetensors file(s)"
                      + (" and the run's tokenizer" if tokenizer else ""), soft_wrap=True)
