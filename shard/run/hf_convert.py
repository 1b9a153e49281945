"""Hugging Face folders to and from shard checkpoints, as library calls: `import_hf_folder` writes a run dir
holding a folder's weights (step 0), `export_hf_folder` a folder transformers loads (and a LoRA
checkpoint's adapters for peft). What `shard import-hf` and `shard export-hf` run."""

import dataclasses
import math
from pathlib import Path

from shard import config as config_mod
from shard.errors import ShardError
from shard.paths import CHECKPOINTS_DIR, check_fresh_out, globless, written_whole
from shard.run.inference import load_model, start_jax

# An import on CPU spreads the weights over this many simulated devices (fsdp) while it writes them: orbax
# writes, and a restore decodes, one device's shard at a time, so a layer stack is stored in 8 chunks
# and neither the write nor a later read holds a whole stack beside the shards.
IMPORT_CPU_DEVICES = 8


def import_hf_folder(hf_dir: Path, out: Path) -> config_mod.ModelConfig:
    """Write the weights of the Hugging Face folder `hf_dir` (any family shard builds) as the step-0
    checkpoint of a new run dir `out`, read tensor by tensor, with the folder's side files (token ids,
    context length, tokenizer) for export-hf; the model it holds."""
    from shard.run.hf_config import is_hf_dir

    if not is_hf_dir(hf_dir):
        what = "does not exist" if not hf_dir.exists() else "is a file" if not hf_dir.is_dir() else \
            "has a config.json that is not a file" if (hf_dir / "config.json").exists() else "holds no config.json"
        raise ShardError(f"{hf_dir} {what}: give a Hugging Face Llama folder (config.json and *.safetensors)")
    check_fresh_out(out)
    tcfg, _, devices = start_jax("1x1", simulate_devices=IMPORT_CPU_DEVICES)
    import jax
    import numpy as np

    from shard.run import hf_side, weights
    from shard.run.checkpoint import Checkpoints
    from shard.training.state import placed_extras

    model_cfg, params, bias = weights.load_with_router_bias(hf_dir, inference=False)
    tcfg = dataclasses.replace(tcfg, model=model_cfg, run_dir=str(out))
    spec = import_spec(tcfg, devices)
    # the weights alone (and DeepSeek's expert-choice bias), placed tensor by tensor: an optimizer state
    # would triple what the import holds, and a fine-tune (--init-from) starts a fresh one anyway
    state = {"step": jax.device_put(np.zeros((), np.int32), spec.shardings["step"]),
             "params": weights.place(params, spec)} | placed_extras(spec, bias)
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
        hf_side.keep_side_files(hf_dir, partial)  # token ids, context length, tokenizer: for export-hf
        hf_side.note_import(hf_dir, partial)  # for a PEFT adapter's base_model_name_or_path
        try:
            ckpts.save(0, state, position=0, seed=tcfg.seed, config_toml=config_toml)
            ckpts.wait()
        finally:
            ckpts.close()
    return model_cfg


def import_spec(tcfg, devices):
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


def check_export(checkpoint: str, out: Path | None, merge: bool, lora_out: Path | None) -> None:
    """That `export_adapters` into `lora_out` and `export_hf_folder` into `out` (a LoRA checkpoint's
    adapters folded in with `merge`) can write what the checkpoint holds, into new folders; JAX started."""
    if out is None and lora_out is None:
        raise ShardError("export-hf needs --out DIR (the model) or --lora-out DIR (a LoRA checkpoint's adapters)")
    if merge and out is None:
        raise ShardError("--merge writes the merged model to --out DIR; give it")
    for folder in (out, lora_out):
        if folder is not None:
            check_fresh_out(folder)
    start_jax()
    lora = _checkpoint_lora(checkpoint)
    if (merge or lora_out) and not lora.rank:
        raise ShardError(f"{checkpoint} holds no LoRA adapters (its run trained every weight): leave out "
                         f"{'--merge' if merge else '--lora-out'}")
    if lora.rank and out is not None and not merge:
        raise ShardError(f"{checkpoint} holds LoRA adapters: --merge folds them into the base weights for --out, "
                         "--lora-out DIR writes them for peft")


def export_adapters(checkpoint: str, lora_out: Path) -> tuple[config_mod.LoraConfig, Path | None]:
    """A LoRA checkpoint's adapters written into the new folder `lora_out` in PEFT's format; their settings
    and the Hugging Face folder named as their base (the run's init_from, or the folder it was imported
    from; None when the base is no such folder: a shard run's own weights, or a fresh init)."""
    from shard.run import hf_peft, hf_side, weights

    _, lora, _, adapters, init_from = weights.load_lora(checkpoint, base=False)
    base = hf_side.hf_origin(init_from) if init_from else None
    with written_whole(lora_out) as partial:
        hf_peft.write_peft_dir(partial, adapters, lora, str(base) if base else "")
    return lora, base


def export_hf_folder(checkpoint: str, out: Path) -> tuple[list, bool]:
    """A checkpoint's model written into the new folder `out` as Hugging Face's (the family its features
    make; a LoRA checkpoint's adapters folded into the base weights): its safetensors files, and whether
    the run's tokenizer went with them."""
    from shard.run import hf, hf_side
    from shard.run.tokenizer import copy_tokenizer

    loaded = load_model(checkpoint, inference=False)  # read on the host, tensor by tensor as it is written
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        files = hf.write_hf_dir(str(partial), loaded.model, loaded.host_params, side=hf_side.side_files_of(checkpoint),
                                router_bias=loaded.host_router_bias)
        # the run's own, when the side files hold none; either way with a config naming its eos for transformers
        tokenizer = copy_tokenizer(checkpoint, partial)
    return files, tokenizer


def _checkpoint_lora(checkpoint) -> config_mod.LoraConfig:
    """The LoRA settings a checkpoint was trained with (rank 0: none, and for a Hugging Face folder)."""
    from shard.run.weights import saved_run_config

    try:
        cfg = saved_run_config(checkpoint)
    except ShardError:
        return config_mod.LoraConfig()  # weights.load says what is wrong with it
    return cfg.lora if cfg is not None else config_mod.LoraConfig()
