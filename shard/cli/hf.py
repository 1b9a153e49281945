"""`shard import-hf` and `shard export-hf`: Hugging Face Llama-family folders (Llama, Qwen2/2.5, Qwen3) to
and from shard checkpoints."""

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from shard.cli.options import CheckpointArg, CheckpointOpt, checkpoint_given, host_jax
from shard import config as config_mod
from shard.errors import ShardError
from shard.observe.console import console, param_count
from shard.paths import CHECKPOINTS_DIR, check_fresh_out, globless, written_whole


def import_hf(
    hf_dir: Annotated[Path, typer.Argument(
        help="a local Hugging Face Llama, Qwen2 or Qwen3 folder (config.json + *.safetensors)")],
    out: Annotated[Path, typer.Option("--out", help="run dir to create with the imported checkpoint")],
):
    """Import a Hugging Face Llama-family model as a shard checkpoint (step 0, fresh optimizer state)."""
    from shard.run.hf import is_hf_dir

    if not is_hf_dir(hf_dir):
        what = "does not exist" if not hf_dir.exists() else "is a file" if not hf_dir.is_dir() else \
            "has a config.json that is not a file" if (hf_dir / "config.json").exists() else "holds no config.json"
        raise ShardError(f"{hf_dir} {what}: give a Hugging Face Llama folder (config.json and *.safetensors)")
    check_fresh_out(out)
    tcfg, mesh_spec, devices = host_jax("1x1")
    from shard.run import hf, weights
    from shard.run.checkpoint import Checkpoints
    from shard.sharding.layout import make_layout
    from shard.training.state import state_spec

    model_cfg, params = weights.load(hf_dir)
    tcfg = dataclasses.replace(tcfg, model=model_cfg, run_dir=str(out))
    layout = make_layout(tcfg, mesh_spec, devices[:1])
    spec = state_spec(model_cfg, tcfg.optimizer, 1, layout)
    restored = weights.state_from(params, spec, tcfg.seed, str(hf_dir))
    globless(out.absolute())
    config_toml = config_mod.to_toml(tcfg)
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        ckpts = Checkpoints(partial / CHECKPOINTS_DIR, tcfg.checkpoint)
        (partial / "config.toml").write_text(config_toml)
        hf.keep_side_files(hf_dir, partial)  # token ids, context length, tokenizer: for export-hf
        try:
            ckpts.save(0, restored.state, position=0, seed=tcfg.seed, config_toml=config_toml)
            ckpts.wait()
        finally:
            ckpts.close()
    console.print(f"imported {hf_dir} ({param_count(model_cfg.num_params())} parameters) into {out}; "
                  f"fine-tune with: shard train --init-from {out} ...", soft_wrap=True)


def export_hf(
    out: Annotated[Path, typer.Option("--out", help="folder to write config.json and safetensors into")],
    checkpoint: CheckpointArg = None,
    checkpoint_opt: CheckpointOpt = None,
):
    """Write a checkpoint's model as a Hugging Face folder that transformers loads (Llama, Qwen2 or Qwen3, by
    the model's features)."""
    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    check_fresh_out(out)
    host_jax()
    from shard.run import hf, weights
    from shard.run.tokenizer import copy_tokenizer

    model_cfg, params = weights.load(checkpoint)
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        files = hf.write_hf_dir(str(partial), model_cfg, params, side=hf.side_files_of(checkpoint))
        tokenizer = copy_tokenizer(checkpoint, partial)  # the run's own, when the side files hold none
    console.print(f"wrote {out}/config.json and {len(files)} safetensors file(s)"
                  + (" and the run's tokenizer" if tokenizer else ""), soft_wrap=True)
