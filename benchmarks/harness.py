"""lm-evaluation-harness throughput: shard's backend (ShardLM on a mesh) against lm-eval's own
Hugging Face backend (`hf`, PyTorch), same CPU, same model, same task; prints figures, never passes
or fails.

    python benchmarks/harness.py                      # the small preset, 200 questions, batch 16
    python benchmarks/harness.py --model tiny --questions 50 --mesh fsdp=2,model=2

1. model: a random-init preset (float32) with a 1,024-id byte-level BPE, written as export-hf writes a
   Hugging Face folder, which both backends read;
2. task: a multiple-choice task YAML over a JSONL of --questions questions (contexts of 5-120 words,
   2-4 choices each), run whole by lm_eval.simple_evaluate;
3. each backend runs it twice, batch --batch: the first run includes shard's compiles (one per bucket
   length) and both backends' warm-up; the second is the steady state. requests/s = the task's
   loglikelihood requests / wall seconds of simple_evaluate;
4. agreement: the largest relative difference between the two backends' loglikelihoods;
5. "none": an LM that answers every request at once, for the harness's own share of the seconds
   (reading the task, building requests, metrics), which both backends pay.
"""

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TEXT = ("the sky is blue grass green water wet fire hot ice cold cats sleep dogs bark birds fly fish swim "
        "rivers run mountains stand old trees grow tall in spring and summer winter brings snow")
WORDS = TEXT.split(" ")


def write_task(folder: Path, questions: int, seed: int = 0) -> Path:
    """A multiple-choice task YAML over a JSONL of `questions` questions; returns the YAML's path."""
    from shard.testing import multiple_choice_task

    rng = random.Random(seed)
    rows = []
    for _ in range(questions):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
        choices = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 4))]
        rows.append({"question": question, "choices": choices, "answer": 0})
    return multiple_choice_task(folder, "bench_mc", rows)


def run(lm, task) -> tuple[float, list[float], float]:
    """(seconds, loglikelihoods in request order, accuracy) of one simple_evaluate of the task."""
    import lm_eval

    from shard.training.harness import task_specs

    manager, specs = task_specs([str(task)])
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - start
    logliks = [float(r[0]) for s in out["samples"]["bench_mc"] for r in s["filtered_resps"]]
    return seconds, logliks, out["results"]["bench_mc"]["acc,none"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch, both backends (default 16)")
    ap.add_argument("--mesh", default="1x1", help="shard's mesh on simulated CPU devices (default 1x1)")
    a = ap.parse_args()

    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    from shard.run.inference import start_jax  # starts JAX with the devices the mesh needs

    tcfg, mesh_spec, devices = start_jax(a.mesh)
    import torch
    from flax import nnx
    from lm_eval.models.huggingface import HFLM

    from shard import models
    from shard.config.presets import PRESETS
    from shard.data.tokenizers import train_bpe
    from shard.run import hf
    from shard.run.harness import harness_lm

    with tempfile.TemporaryDirectory() as tmp:
        folder, hf_dir = Path(tmp), Path(tmp) / "hf"
        task = write_task(folder, a.questions)
        tok = train_bpe([TEXT] * 100, 1024, hf_dir)
        cfg = dataclasses.replace(PRESETS[a.model], vocab_size=tok.vocab_size, compute_dtype="float32")
        hf.write_hf_dir(str(hf_dir), cfg, nnx.to_pure_dict(nnx.state(models.build(cfg))))
        print(f"model {a.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}), "
              f"{a.questions} questions, batch {a.batch}, torch threads {torch.get_num_threads()}, "
              f"{os.cpu_count()} CPU(s)")

        from lm_eval.api.model import LM

        class Instant(LM):
            def loglikelihood(self, requests, disable_tqdm=False):
                return [(0.0, False)] * len(requests)

            loglikelihood_rolling = generate_until = None

        figures = {}
        backends = {
            "none": Instant,
            "hf": lambda: HFLM(pretrained=str(hf_dir), device="cpu", batch_size=a.batch, dtype="float32"),
            f"shard {a.mesh}": lambda: harness_lm(hf_dir, tcfg, mesh_spec, devices, a.batch),
        }
        for name, make in backends.items():
            lm = make()
            first, logliks, acc = run(lm, task)
            second, _, _ = run(lm, task)
            n = len(logliks)
            figures[name] = logliks
            extra = ""
            if hasattr(lm, "scorer"):
                s = lm.scorer
                extra = (f"; {len(s.shapes)} bucket length(s) {sorted(s.shapes)}, padding "
                         f"{1 - s.real_tokens / s.padded_tokens:.0%} of the batches' positions")
            print(f"{name:>16}: {n} requests, first run {first:.1f} s ({n / first:,.1f} req/s), steady "
                  f"{second:.1f} s ({n / second:,.1f} req/s), acc {acc:.3f}{extra}")
        ours, theirs = (figures[k] for k in (f"shard {a.mesh}", "hf"))
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(ours, theirs))
        print(f"agreement: largest relative loglikelihood difference {worst:.2e} over {len(ours)} requests")


if __name__ == "__main__":
    main()
