"""`shard import-hf` and `shard export-hf`: Hugging Face Llama-family folders (Llama, Qwen2/2.5, Qwen3) to
and from shard checkpoints."""

import dataclasses
import math
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
    """Import a Hugging Face model (any family shard builds) as a shard checkpoint of its weights, read tensor by
    tensor; fine-tune it with --init-from."""
    from shard.run.hf import is_hf_dir

    if not is_hf_dir(hf_dir):
        what = "does not exist" if not hf_dir.exists() else "is a file" if not hf_dir.is_dir() else \
            "has a config.json that is not a file" if (hf_dir / "config.json").exists() else "holds no config.json"
        raise ShardError(f"{hf_dir} {what}: give a Hugging Face Llama folder (config.json and *.safetensors)")
    check_fresh_out(out)
    tcfg, _, devices = host_jax("1x1", simulate_devices=IMPORT_CPU_DEVICES)
    import jax
    import numpy as np

    from shard.run import hf, weights
    from shard.run.checkpoint import Checkpoints

    model_cfg, params = weights.load(hf_dir)
    tcfg = dataclasses.replace(tcfg, model=model_cfg, run_dir=str(out))
    spec = _import_spec(tcfg, devices)
    # the weights alone, placed tensor by tensor: an optimizer state would triple what the import holds,
    # and a fine-tune (--init-from) starts a fresh one anyway
    state = {"step": jax.device_put(np.zeros((), np.int32), spec.shardings["step"]),
             "params": weights.place(params, spec)}
    globless(out.absolute())
    config_toml = config_mod.to_toml(tcfg)
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        # a quarter GB written at a time, or the largest shard: orbax's default buffers every chunk at
        # once (a second copy), and refuses a shard larger than its limit
        largest = max(math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize for a, sharding in
                      zip(jax.tree.leaves(spec.abstract["params"]), jax.tree.leaves(spec.shardings["params"])))
        ckpts = Checkpoints(partial / CHECKPOINTS_DIR, tcfg.checkpoint,
                            write_concurrent_gb=max(0.25, 1.01 * largest / 1e9))
        (partial / "config.toml").write_text(config_toml)
        hf.keep_side_files(hf_dir, partial)  # token ids, context length, tokenizer: for export-hf
        try:
            ckpts.save(0, state, position=0, seed=tcfg.seed, config_toml=config_toml)
            ckpts.wait()
        finally:
            ckpts.close()
    console.print(f"imported {hf_dir} ({param_count(model_cfg.num_params())} parameters) into {out}; "
                  f"fine-tune with: shard train --init-from {out} ...", soft_wrap=True)


# An import on CPU spreads the weights over this many simulated devices (fsdp) while it writes them: orbax
# writes, and a restore decodes, one device's shard at a time, so a layer stack is stored in 8 chunks
# and neither the write nor a later read holds a whole stack beside the shards.
IMPORT_CPU_DEVICES = 8


def _import_spec(tcfg, devices):
    """The state spec an import writes through: fsdp over the CPU devices (8, or the most of 4, 2 that
    divide the model's dims), or one device on an accelerator."""
    ways = (IMPORT_CPU_DEVICES, 4, 2) if devices[0].platform == "cpu" else ()
    for n in (w for w in ways if w <= len(devices)):
        try:
            return _spec_on(tcfg, devices, n)
        except ShardError:
            continue  # a dim n does not divide: fewer devices
    return _spec_on(tcfg, devices, 1)


def _spec_on(tcfg, devices, n: int):
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.training.state import state_spec

    layout = make_layout(tcfg, parse_mesh(f"fsdp={n}" if n > 1 else "1x1"), devices[:n])
    return state_spec(tcfg.model, tcfg.optimizer, 1, layout)


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
    checkpoint = checkpoint_given(checkpoint, checkpoint_opt)
    if out is None and lora_out is None:
        raise ShardError("export-hf needs --out DIR (the model) or --lora-out DIR (a LoRA checkpoint's adapters)")
    if merge and out is None:
        raise ShardError("--merge writes the merged model to --out DIR; give it")
    for folder in (out, lora_out):
        if folder is not None:
            check_fresh_out(folder)
    host_jax()
    from shard.run import hf, weights
    from shard.run.tokenizer import copy_tokenizer

    lora = _checkpoint_lora(checkpoint)
    if (merge or lora_out) and not lora.rank:
        raise ShardError(f"{checkpoint} holds no LoRA adapters (its run trained every weight): leave out "
                         f"{'--merge' if merge else '--lora-out'}")
    if lora.rank and out is not None and not merge:
        raise ShardError(f"{checkpoint} holds LoRA adapters: --merge folds them into the base weights for --out, "
                         "--lora-out DIR writes them for peft")
    if lora_out is not None:
        _, lora, _, adapters, base = weights.load_lora(checkpoint, base=False)
        with written_whole(lora_out) as partial:
            hf.write_peft_dir(partial, adapters, lora, base)
        console.print(f"wrote {lora_out}/adapter_config.json and adapter_model.safetensors (rank {lora.rank}, "
                      f"{', '.join(lora.targets)})", soft_wrap=True)
        if out is None:
            return
    model_cfg, params = weights.load(checkpoint)  # a LoRA checkpoint's adapters folded in
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        files = hf.write_hf_dir(str(partial), model_cfg, params, side=hf.side_files_of(checkpoint))
        tokenizer = copy_tokenizer(checkpoint, partial)  # the run's own, when the side files hold none
    console.print(f"wrote {out}/config.json and {len(files)} safetensors file(s)"
                  + (" and the run's tokenizer" if tokenizer else ""), soft_wrap=True)


def _checkpoint_lora(checkpoint):
    """The LoRA settings a checkpoint was trained with (rank 0: none, and for a Hugging Face folder)."""
    from shard.run.weights import saved_run_config

    try:
        cfg = saved_run_config(checkpoint)
    except ShardError:
        return config_mod.LoraConfig()  # weights.load says what is wrong with it
    return cfg.lora if cfg is not None else config_mod.LoraConfig()
