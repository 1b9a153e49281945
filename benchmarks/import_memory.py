"""Host memory of reading a Hugging Face folder: peak RSS of `shard import-hf`, of `shard generate` from the
folder and of `shard generate` from the imported checkpoint, beside the bound they are meant to stay within:
the model's placed shards (float32, the padded tables) plus its largest tensor, over the runtime's own
(the peak RSS of a process that imports shard's JAX stack and starts its one-device mesh).

    python benchmarks/import_memory.py [--shape llama-1b] [--files 4] [--workdir /tmp/import-mem] [--keep]

The folder is synthetic: a transformers-style config.json of the shape (a preset, or `llama-3b`: Llama 3.2
3B's dimensions) and random bfloat16 tensors streamed into `--files` safetensors files with an index, no
torch model built. Each command is a fresh process (one simulated device, as a user starts it); its peak
RSS is its own (os.wait4's ru_maxrss), which counts the pages of the memory-mapped safetensors files it
has touched. The folder and the checkpoint are removed at the end unless --keep.
"""

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

GB = 1e9
# Llama 3.2 3B's dimensions (tied tables), for a model past what the presets hold between 1B and 7B
EXTRA_SHAPES = {"llama-3b": dict(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                                 head_dim=128, mlp_dim=8192, rope_theta=500000.0)}
# as a `shard` command starts: glibc's huge pages for malloc where the CLI turns them on, then JAX
RUNTIME = ("from shard.startup.host_memory import reexec_with_huge_pages; reexec_with_huge_pages(); "
           "from shard.run.inference import start_jax; start_jax('1x1'); "
           "import jax.numpy as jnp, orbax.checkpoint, shard.run.weights, shard.training.state; "
           "jnp.zeros(8).block_until_ready()")


def model_config(shape: str):
    from shard.config.model import ModelConfig
    from shard.config.presets import PRESETS

    if shape in EXTRA_SHAPES:
        return ModelConfig(name=shape, **EXTRA_SHAPES[shape])
    if shape not in PRESETS:
        raise SystemExit(f"unknown shape {shape}: one of {sorted(PRESETS) + sorted(EXTRA_SHAPES)}")
    return dataclasses.replace(PRESETS[shape], name=shape)


def write_folder(cfg, root: Path, files: int, seed: int = 0) -> int:
    """A Hugging Face folder of random bfloat16 tensors in `files` safetensors files; its bytes."""
    from safetensors.numpy import save_file

    from shard.run.hf import config_to_hf, expected_hf_shapes

    shapes = expected_hf_shapes(cfg)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config_to_hf(cfg) | {"torch_dtype": "bfloat16"}, indent=1))
    rng = np.random.default_rng(seed)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    weight_map, current, size, index = {}, {}, 0, 0
    for n, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            t = np.ones(shape, ml_dtypes.bfloat16)
        else:
            t = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        current[name] = t
        size += t.nbytes
        weight_map[name] = names[index]
        if size >= total / files * (index + 1) or n == len(shapes) - 1:  # a file's share written, one at a time
            save_file(current, str(root / names[index]), metadata={"format": "pt"})
            current, index = {}, min(index + 1, files - 1)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def peak_rss(cmd: list[str], log: Path) -> tuple[float, float]:
    """(peak RSS in GB, seconds) of one command, run to its end; its output goes to `log`."""
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        seconds = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} exited {os.waitstatus_to_exitcode(status)}:\n{log.read_text()[-2000:]}")
    return usage.ru_maxrss * 1024 / GB, seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-1b", help="a preset's name, or llama-3b (Llama 3.2 3B's dimensions)")
    ap.add_argument("--files", type=int, default=4, help="safetensors files the folder is split into")
    ap.add_argument("--tokens", type=int, default=4, help="tokens `generate` samples")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/import-mem"))
    ap.add_argument("--keep", action="store_true", help="keep the folder and the checkpoint")
    ap.add_argument("--hf-dir", type=Path, help="measure this Hugging Face folder (kept) instead of writing one")
    ap.add_argument("--write-folder", type=Path, help=argparse.SUPPRESS)  # the child that writes it
    args = ap.parse_args()
    if args.write_folder:
        print(write_folder(model_config(args.shape), args.write_folder, args.files))
        return

    if args.hf_dir:
        from shard.run.hf import config_from_hf
        from shard.run.hf_config import read_json

        cfg = config_from_hf(read_json(args.hf_dir / "config.json"), name=args.hf_dir.name)
        args.shape = args.hf_dir.name
    else:
        cfg = model_config(args.shape)
    from shard.run.hf import expected_hf_shapes

    # float32 as placed: the tables padded; the largest tensor is an HF one (a layer's, an expert's) or a table
    shards = sum(math.prod(s) * 4 for _, s, _ in cfg.param_shapes()) / GB
    largest = max(cfg.padded_vocab * cfg.d_model, *map(math.prod, expected_hf_shapes(cfg).values())) * 4 / GB
    work = args.workdir / args.shape
    if work.exists():
        raise SystemExit(f"{work} exists: remove it or give another --workdir")
    hf_dir, out = args.hf_dir or work / "hf", work / "imported"
    work.mkdir(parents=True)
    try:
        t0 = time.monotonic()
        if args.hf_dir:
            on_disk, files = [sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")), "its"]
        else:  # in a child: a process started from this one would count its pages (Linux keeps the
            # peak RSS of the process it was forked from), so this one stays small
            on_disk = int(subprocess.run([sys.executable, __file__, "--shape", args.shape, "--files", str(args.files),
                                          "--write-folder", str(hf_dir)], check=True, capture_output=True,
                                         text=True).stdout)
            files = args.files
        print(f"{args.shape}: {cfg.num_params() / 1e9:.2f}B parameters, {on_disk / GB:.2f} GB in {files} "
              f"safetensors files ({time.monotonic() - t0:.0f} s to write)", flush=True)
        runtime, _ = peak_rss([sys.executable, "-c", RUNTIME], work / "runtime.txt")
        print(f"bound: shards {shards:.2f} GB + largest tensor {largest:.2f} GB (float32) = "
              f"{shards + largest:.2f} GB, + runtime {runtime:.2f} GB = {shards + largest + runtime:.2f} GB", flush=True)
        shard_cmd = [sys.executable, "-m", "shard"]
        prompt = ["--prompt-ids", "1,2,3", "--max-new-tokens", str(args.tokens), "--temperature", "0", "--ids"]
        runs = [("import-hf", [*shard_cmd, "import-hf", str(hf_dir), "--out", str(out)]),
                ("generate (folder)", [*shard_cmd, "generate", str(hf_dir), *prompt]),
                ("generate (checkpoint)", [*shard_cmd, "generate", str(out), *prompt])]
        for name, cmd in runs:
            rss, seconds = peak_rss(cmd, work / f"{name.split()[0]}-{len(name)}.txt")
            print(f"{name:22s} peak RSS {rss:6.2f} GB = runtime + shards {rss - runtime - shards:+.2f} GB "
                  f"(bound: + {largest:.2f})  {seconds:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
