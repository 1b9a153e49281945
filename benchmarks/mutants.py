"""Mutation testing on demand: plausible bugs put into shard one at a time, each with the tests that must
catch it. Not run in CI (it runs the named tests once per mutant); tests/test_benchmarks.py checks
only that every patch still applies to the source and every test it names still exists.

    python benchmarks/mutants.py                  # every mutant: a table and the score
    python benchmarks/mutants.py --quick          # leave out those whose killers are end-to-end runs
    python benchmarks/mutants.py --only dpo-swap --only sft-mask-shift
    python benchmarks/mutants.py --list
    python benchmarks/mutants.py --why            # and, under each killed one, the failure pytest reported

How: the repository's files (git's tracked and untracked, not its ignored ones) are copied once to a
temporary folder; for each mutant its one exact piece of text is replaced there, its tests are run
(`pytest -n 0 -x`, with the copy first on PYTHONPATH) and the file is put back. A mutant is killed when
a test fails, survives when they all pass, and is an error when pytest could not run them (a node id
that no longer exists). The tests are first run once unmutated: a test that fails there kills nothing.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # occurs exactly once in `file`
    new: str
    tests: tuple[str, ...]  # pytest node ids, at least one of which must fail
    why: str  # the bug it stands for
    slow: bool = False  # its tests are end-to-end runs (left out by --quick)


MUTANTS = [
    # issue 53's seven, which every test once missed
    Mutant("dpo-swap", "shard/data/finetune.py", "enumerate(((ci, cf), (ri, rf)))", "enumerate(((ri, rf), (ci, cf)))",
           ("tests/test_finetune.py::test_dpo_loss_matches_a_hand_computation",),
           "DPO rows hold the rejected completion first: the run optimises toward the rejected answers"),
    Mutant("sft-mask-shift", "shard/data/batches.py", 'windows["trained"][:, 1:] > 0', 'windows["trained"][:, :-1] > 0',
           ("tests/test_finetune.py::test_sft_trains_exactly_the_assistant_answers",),
           "the SFT loss mask one token late: the token after a turn trained, its first token not"),
    Mutant("bos-post-processor", "shard/data/tokenizers.py", 'config.get("add_bos_token", uses)',
           'config.get("add_bos_token", False)',
           ("tests/test_tokenizers.py::test_bos_added_by_a_post_processor_starts_documents",),
           "a BOS that only the tokenizer's post-processor adds (Llama 3) is left out of documents"),
    Mutant("dpo-resume-reference", "shard/training/dpo.py", "    if reference is not None:\n",
           "    if False:  # mutant\n",
           ("tests/test_finetune.py::test_sft_then_dpo_from_its_checkpoint_and_a_dpo_resume",),
           "a resumed DPO run takes the seed's fresh init as its reference, not the --init-from weights", slow=True),
    Mutant("capacity-slot", "shard/models/moe.py", "jnp.cumsum(mask_bte, axis=1) - 1.0 + counts_be",
           "jnp.cumsum(mask_bte, axis=1) + counts_be", ("tests/test_parallel.py::test_routing_respects_capacity",),
           "capacity routing loses one slot per expert"),
    Mutant("lora-resume-base", "shard/run/checkpoint.py",
           "        check_lora_base(meta.get(LORA_BASE_FINGERPRINT), state_fingerprint(base), self.path(step), saved)\n",
           "",
           ("tests/test_lora.py::test_a_lora_checkpoint_is_refused_as_a_whole_model_and_its_base_is_checked",),
           "a LoRA resume onto base weights other than its adapters were trained on goes unchecked"),
    Mutant("mixture-seed", "shard/data/mixture.py", "np.random.default_rng([self.seed, b])",
           "np.random.default_rng([0, b])",
           ("tests/test_packing.py::test_mixture_is_a_pure_function_of_seed_and_index",),
           "the mixture's order ignores its seed"),
    # the tests issue 53 found weak: sampling and accumulation
    Mutant("temperature-inverted", "shard/training/generate.py",
           "keepdims=True)) / s.temperature", "keepdims=True)) * s.temperature",
           ("tests/test_generate.py::test_sampling_filters",),
           "sampling multiplies the logits by the temperature instead of dividing"),
    Mutant("accumulate-last-only", "shard/training/step.py", "return (jax.tree.map(jnp.add, g_acc, g), nll_acc",
           "return (g, nll_acc", ("tests/test_step.py::test_microbatches_accumulate_to_the_step_of_one_big_batch",),
           "gradient accumulation keeps the last microbatch's gradients only"),
    # more, in code touched since
    Mutant("dpo-ratio-sign", "shard/training/dpo.py", "beta * (policy_b - reference_b)",
           "beta * (reference_b - policy_b)",
           ("tests/test_finetune.py::test_dpo_loss_matches_a_hand_computation",),
           "DPO's rewards are the reference over the policy"),
    Mutant("dpo-ascends", "shard/training/dpo.py", "apply(state, grads, loss, pairs, moe, args)",
           "apply(state, jax.tree.map(jnp.negative, grads), loss, pairs, moe, args)",
           ("tests/test_finetune.py::test_dpo_loss_matches_a_hand_computation",),
           "the DPO step climbs its loss: the rejected answers gain on the chosen (its metrics stay right)"),
    Mutant("lora-load-base", "shard/run/weights.py",
           "    check_lora_base(saved_meta(directory / str(step)).get(LORA_BASE_FINGERPRINT), read, path, saved)\n",
           "",
           ("tests/test_lora.py::test_a_lora_checkpoint_is_refused_as_a_whole_model_and_its_base_is_checked",),
           "generate/export of a LoRA checkpoint onto a changed base goes unchecked"),
    Mutant("store-name-with-slash", "shard/data/token_store.py", 'if any(c in name for c in "/\\\\\\0"):',
           'if any(c in name for c in "\\\\\\0"):',
           ("tests/test_store.py::test_store_json_is_checked_whole_in_one_line_naming_the_field[folder]",),
           "a shard named with a folder (tokenizer/tokens.bin) is read from inside another folder"),
    Mutant("store-max-token-range", "shard/data/token_store.py", "not -1 <= top < vocab", "not -1 <= top <= vocab",
           ("tests/test_store.py::test_store_json_is_checked_whole_in_one_line_naming_the_field[max_token vocab]",),
           "a recorded max_token equal to the vocabulary size is accepted"),
    Mutant("store-shard-twice", "shard/data/token_store.py", '            seen[real] = f"shards[{i}].{k}"\n', "",
           ("tests/test_store.py::test_store_json_is_checked_whole_in_one_line_naming_the_field[twice]",),
           "the same shard listed twice in store.json is read twice"),
    Mutant("ids-at-vocab", "shard/data/samples.py", "if top >= vocab or wrapped:", "if top > vocab or wrapped:",
           ("tests/test_store.py::test_a_uint32_id_past_int32_is_not_read_as_padding",),
           "a token id equal to the vocabulary size passes the batch's check"),
    Mutant("ids-padding-wrapped", "shard/data/samples.py",
           "np.count_nonzero(ids < 0) != np.count_nonzero(padding)", "int(ids.min()) < 0",
           ("tests/test_store.py::test_a_uint32_id_past_int32_is_not_read_as_padding",),
           "packed rows' padding (-1) is taken for a wrapped id"),
    Mutant("weights-tokenizer-ignored", "shard/run/tokenizer.py", "    if not cfg.data.tokenizer:\n",
           "    if False:  # mutant\n",
           ("tests/test_finetune.py::test_a_fine_tune_reads_its_data_with_the_tokenizer_its_weights_came_with",),
           "--init-from weights with their own tokenizer fine-tune on bytes", slow=True),
    Mutant("sizes-microbatches", "shard/cluster/sizes.py", "if self.batch % (ways * self.microbatches):",
           "if self.batch % ways:",
           ("tests/test_elastic.py::test_the_largest_size_that_the_mesh_and_the_batch_divide_is_chosen",),
           "an elastic size whose data-parallel rows don't split into the microbatches is chosen"),
    Mutant("sizes-never-the-minimum", "shard/cluster/sizes.py",
           "for n in range(min(available, self.max_processes), self.min_processes - 1, -1):",
           "for n in range(min(available, self.max_processes), self.min_processes, -1):",
           ("tests/test_elastic.py::test_the_largest_size_that_the_mesh_and_the_batch_divide_is_chosen",),
           "an elastic job never shrinks to --min-processes"),
    Mutant("events-are-a-run", "shard/observe/metrics.py", "is not None and not is_event(r) for line",
           "is not None for line",
           ("tests/test_run_start.py::test_a_run_dir_whose_metrics_hold_only_a_supervisors_events_holds_no_run_yet",),
           "a run dir holding only a supervisor's events is taken for a run"),
    Mutant("read-lines-offset", "shard/observe/metrics.py", "        f.seek(offset)\n", "",
           ("tests/test_observe.py::test_goodput_counts_only_the_steps_a_launch_held",),
           "the supervisor re-reads the whole metrics.jsonl, its earlier records with the new"),
    Mutant("snapshot-folder-unresolved", "shard/run/snapshots.py", "str(run_dir.resolve()).encode()",
           "str(run_dir).encode()",
           ("tests/test_checkpoint.py::test_snapshots_go_to_the_ram_disk_by_run_dir_or_to_the_run_dir_and_need_room_"
            "for_two",),
           "one run dir named two ways gets two snapshot folders (a restart misses its snapshots)"),
    # issue 51's GRPO: the loss terms, a reward, the rollouts' wiring
    Mutant("grpo-std-biased", "shard/training/grpo.py", "keepdims=True, ddof=1)", "keepdims=True, ddof=0)",
           ("tests/test_grpo.py::test_advantages_are_each_reward_less_its_group_mean_over_its_std",),
           "the group's std divided by G, not G - 1 (as TRL and verl): advantages scaled otherwise than documented"),
    Mutant("grpo-clip-high-is-low", "shard/training/grpo.py", "1.0 - cfg.clip_low, 1.0 + cfg.clip_high)",
           "1.0 - cfg.clip_low, 1.0 + cfg.clip_low)",
           ("tests/test_grpo.py::test_the_clipped_surrogate_kl_and_normalisers_equal_numpy",),
           "DAPO's clip-higher ignored: the ratio clipped above at 1 + clip_low"),
    Mutant("grpo-no-tis", "shard/training/grpo.py", "loss_bt = loss_bt * weight_bt", "loss_bt = loss_bt",
           ("tests/test_grpo.py::test_the_clipped_surrogate_kl_and_normalisers_equal_numpy",),
           "the truncated importance weights computed and never applied"),
    Mutant("grpo-kl-k1", "shard/training/grpo.py", "jnp.exp(r_bt) - r_bt - 1.0", "jnp.exp(r_bt) - 1.0",
           ("tests/test_grpo.py::test_the_clipped_surrogate_kl_and_normalisers_equal_numpy",),
           "the KL estimate not k3 (a biased, possibly negative penalty)"),
    Mutant("grpo-first-hash", "shard/training/rewards.py", "return found[-1].strip() if found",
           "return found[0].strip() if found", ("tests/test_grpo.py::test_the_built_in_rewards_extract_the_final_answer",),
           "the answer reward reads the first `####`, not the final answer"),
    Mutant("grpo-advantage-sign", "shard/training/rollouts.py", "advantages = np.asarray(grpo.group_advantages(",
           "advantages = -np.asarray(grpo.group_advantages(",
           ("tests/test_grpo.py::test_grpo_raises_a_toy_reward_resumes_bit_for_bit_and_matches_another_layout",),
           "the advantages' sign flipped: GRPO lowers the reward", slow=True),
    Mutant("grpo-key-not-the-steps", "shard/training/rollouts.py", "jax.random.fold_in(self.key, index)",
           "jax.random.fold_in(self.key, time.perf_counter_ns() % 2**31)",
           ("tests/test_grpo.py::test_grpo_raises_a_toy_reward_resumes_bit_for_bit_and_matches_another_layout",),
           "sampling keys not derived from the step: a resumed run samples other completions", slow=True),
    Mutant("grpo-sampler-logps-shifted", "shard/training/rollouts.py", "start = len(prompts[i // group].ids) - 1",
           "start = len(prompts[i // group].ids)",
           ("tests/test_grpo.py::test_grpo_raises_a_toy_reward_resumes_bit_for_bit_and_matches_another_layout",),
           "the sampler's log-probabilities one target late: the importance weights compare other tokens", slow=True),
    Mutant("grpo-sampler-without-adapters", "shard/training/generate.py", "adapting(lora, None):",
           "adapting(None, None):", ("tests/test_grpo.py::test_a_lora_run_samples_with_its_adapters",),
           "a LoRA run's sampler leaves its adapters out"),
]


def check_patches(root: Path = ROOT, mutants=MUTANTS) -> list[str]:
    """What keeps a mutant from applying to the source at `root`: its text not found exactly once, a
    test file or test function it names gone, a name used twice. [] when all apply."""
    problems, names = [], set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: the name is used twice")
        names.add(m.name)
        path = root / m.file
        count = path.read_text(encoding="utf-8").count(m.old) if path.is_file() else 0
        if count != 1:
            problems.append(f"{m.name}: its text occurs {count} times in {m.file}, not once")
        for node in m.tests:
            file, _, function = node.partition("::")
            test = root / file
            if not test.is_file() or f"def {function.split('[')[0]}(" not in test.read_text(encoding="utf-8"):
                problems.append(f"{m.name}: no test {node}")
    return problems


def copy_repo(root: Path, to: Path) -> None:
    """The files git holds or would hold (tracked, and untracked but not ignored) copied to `to`; without
    git, the tree less its environments, caches and runs."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True)
    if listed.returncode:
        shutil.copytree(root, to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", ".pytest_cache", "runs", "*.egg-info"))
        return
    listed = listed.stdout.decode().split("\0")
    for name in filter(None, listed):
        source = root / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)


def run_tests(copy: Path, tests, timeout: float) -> tuple[str, float, str]:
    """("passed" | "failed" | "error: ..." | "timeout", seconds, pytest's line on the first failure) of
    the tests run in the copy."""
    # the repository's compilation cache (tests/conftest.py's), not a cold one in the copy
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax"))
    env = {**os.environ, "PYTHONPATH": str(copy), "JAX_COMPILATION_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "COLUMNS": "300"}  # the short summary's failure line whole
    command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
               *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    lines = done.stdout.splitlines()
    failed = next((line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))), "")
    error = next((line[1:].strip() for line in lines if line.startswith("E ")), "")  # its first line
    failure = f"{failed}: {error}" if failed and error else failed
    if done.returncode in (0, 1):
        return ("passed", "failed")[done.returncode], seconds, failure
    last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
    return f"error: pytest exit {done.returncode} ({last[0][:120]})", seconds, failure


def mutate(copy: Path, m: Mutant, timeout: float) -> tuple[str, float, str]:
    """The mutant's outcome: killed, survived, or why neither; its tests' seconds; the failure's line."""
    path = copy / m.file
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace(m.old, m.new, 1), encoding="utf-8")
    try:
        outcome, seconds, failure = run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(original, encoding="utf-8")
    outcome = {"failed": "killed", "passed": "SURVIVED", "timeout": "killed (timeout)"}.get(outcome, outcome)
    return outcome, seconds, failure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="this mutant only (repeatable)")
    parser.add_argument("--quick", action="store_true", help="leave out the mutants whose tests are end-to-end runs")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one mutant's tests (default 600)")
    parser.add_argument("--why", action="store_true", help="under each killed mutant, pytest's line on the failure")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (not args.only or m.name in args.only) and not (args.quick and m.slow)]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        print(f"error: no mutant named {', '.join(sorted(unknown))} (see --list)", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:28s} {m.file:28s} {m.why}")
        return 0
    if problems := check_patches(ROOT, chosen):
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="shard-mutants-") as tmp:
        copy = Path(tmp)
        copy_repo(ROOT, copy)
        tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
        baseline, seconds, _ = run_tests(copy, tests, args.timeout * len(chosen))
        print(f"unmutated: the {len(tests)} tests {baseline} ({seconds:.0f} s)")
        if baseline != "passed":
            print("error: the tests must pass unmutated for a failure to mean anything", file=sys.stderr)
            return 1
        print(f"{'mutant':28s} {'file':28s} {'outcome':18s} seconds")
        killed = 0
        for m in chosen:
            outcome, seconds, failure = mutate(copy, m, args.timeout)
            killed += outcome.startswith("killed")
            print(f"{m.name:28s} {m.file:28s} {outcome:18s} {seconds:7.1f}", flush=True)
            if args.why and failure:
                print(f"    {failure[:200]}", flush=True)
    print(f"score: {killed}/{len(chosen)} mutants killed")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
