"""lm-evaluation-harness on the mesh: `ShardLM`, a backend for lm_eval's `LM` interface
(loglikelihood, loglikelihood_rolling, generate_until) that scores with shard.training.scoring.Scorer
and generates with shard.training.generate.Generator, both laid out as training lays the model out;
`run_tasks` runs lm-eval tasks, named or given as task YAML files, on it.

Importing this module needs lm-eval (`./install.sh eval`): without it the import is a
ShardError, so a command that asks for tasks says so in one line. With it, the backend is registered
with lm-eval as "shard".
"""

import contextlib
import json
import math
import os
import subprocess
from pathlib import Path

from shard.errors import ShardError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:
    raise ShardError("benchmark tasks need lm-eval: ./install.sh eval") from None

from shard.data.tokenizers import Tokenizer, encode
from shard.training.scoring import Scorer

MAX_GEN_TOKS = 256  # lm-eval's default for generation tasks that give no max_gen_toks
YAML_SUFFIXES = (".yaml", ".yml")


@register_model("shard")
class ShardLM(TemplateLM):
    """lm-eval's view of a model on a mesh. Tokens are the model's tokenizer's, with its BOS where it
    starts documents with one, as lm-eval's `hf` backend encodes them; sequences past `max_length`
    lose their oldest tokens, as there."""

    def __init__(self, scorer: Scorer, tokenizer: Tokenizer, max_length: int, max_gen_toks: int = MAX_GEN_TOKS):
        super().__init__()
        self.scorer, self.shard_tokenizer = scorer, tokenizer
        self._max_length, self.max_gen_toks = max_length, max_gen_toks
        self._generator = None  # built on the first generation request

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        raise ShardError("the shard backend is built around a model on a mesh: run `shard eval CHECKPOINT "
                         "--tasks ...`, or pass shard.training.harness.ShardLM(...) to lm_eval.simple_evaluate")

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        tok = self.shard_tokenizer
        return tok.eos_id if tok.eos_id is not None else self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS, else EOS (as the `hf` backend), else a newline
        (the byte tokenizer has neither)."""
        tok = self.shard_tokenizer
        for token in (tok.bos_id, tok.eos_id):
            if token is not None:
                return token
        return int(encode(tok, "\n")[0])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        tok = self.shard_tokenizer
        ids = encode(tok, string).tolist()
        bos = tok.add_bos if add_special_tokens is None else add_special_tokens
        if bos and tok.bos_id is not None and not (ids and ids[0] == tok.bos_id):
            ids = [tok.bos_id] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids) -> str:
        return self.shard_tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError("a request needs a context and a continuation of at most max_length tokens")
            rows.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
        answers = self.scorer.score(rows)
        for (request, _, _), answer in zip(requests, answers):
            if request is not None and request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in windows of max_length tokens, as the `hf` backend cuts them."""
        from lm_eval import utils

        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            cut = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, *w) for w in cut]
            counts.append(len(cut))
        scores = [lp for lp, _ in self._loglikelihood_tokens(windows)]
        out, at = [], 0
        for request, n in zip(requests, counts):
            out.append(float(sum(scores[at:at + n])))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled where a task asks for do_sample with a temperature), each cut
        at the first of its stop strings."""
        from shard.training.generate import Generator, Sampling

        if self._generator is None:
            s = self.scorer
            self._generator = Generator(s.spec.model, s.spec.graphdef, s.params, s.layout, self.max_length,
                                        router_bias=s.router_bias)
        out = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            new = min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - new) or [self.prefix_token_id]
            out.append(self._continue(prompt, new, Sampling(temperature=temperature), until))
            self.cache_hook.add_partial("generate_until", request.args, out[-1])
        return out

    def _continue(self, prompt: list[int], new: int, sampling, until: list[str]) -> str:
        ids: list[int] = []
        for token in self._generator.stream(prompt, new, sampling):
            if token == self.shard_tokenizer.eos_id:
                break
            ids.append(token)
            text = self.tok_decode(ids)
            if any(stop and stop in text for stop in until):
                break
        text = self.tok_decode(ids)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def task_specs(tasks: list[str]) -> tuple:
    """(an lm_eval TaskManager, the tasks as simple_evaluate takes them): lm-eval task names, checked
    against its index, and task YAML files, read here (their folders join the manager's include_path,
    so a file's `include:` and group members resolve). An unknown name or a file that does not parse
    is a ShardError."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    if not tasks:
        raise ShardError("no task given: name lm-eval tasks or task YAML files (--tasks hellaswag,my_task.yaml)")
    specs, folders, names = [], [], []
    for task in tasks:
        path = Path(task)
        if path.suffix not in YAML_SUFFIXES:
            names.append(task)
            specs.append(task)
            continue
        if not path.is_file():
            raise ShardError(f"task file {task} not found")
        try:
            config = load_yaml(path, resolve_func=True)
        except Exception as e:  # noqa: BLE001 - yaml, an include cycle, a !function that does not import
            raise ShardError(f"task file {task} does not parse: {' '.join(str(e).split())[:200]}") from None
        if not ("task" in config or "group" in config):
            raise ShardError(f"task file {task} names no task (its `task:` key)")
        specs.append(config)
        folders.append(str(path.resolve().parent))
    manager = TaskManager(include_path=sorted(set(folders)) or None, include_defaults=bool(names))
    for name in names:
        if not manager.match_tasks([name]):
            raise ShardError(f"unknown task {name!r}: not one of lm-eval's tasks (`lm-eval ls tasks`) nor a "
                             "task YAML file (*.yaml)")
    return manager, specs


def check_counts(num_fewshot: int | None, limit: int | None) -> None:
    """--num-fewshot and --limit, before anything loads."""
    if limit is not None and limit < 1:
        raise ShardError(f"--limit must be positive (examples per task), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ShardError(f"--num-fewshot must be 0 or more, got {num_fewshot}")


def run_tasks(lm: ShardLM, tasks, num_fewshot: int | None = None, limit: int | None = None,
              bootstrap_iters: int = 100_000, seed_globals: bool = True) -> dict:
    """lm-eval's results dict (results, configs, versions, n-shot, ...) for `tasks` on `lm`: task
    names and YAML files, or what `task_specs` made of them (read once, run many times).
    `seed_globals`: lm-eval seeds Python's, numpy's and torch's global generators, as its own runs
    do; off inside training, whose state is not lm-eval's to reset (few-shot sampling stays seeded)."""
    import lm_eval

    check_counts(num_fewshot, limit)
    manager, specs = task_specs(tasks) if isinstance(tasks, list) else tasks
    seeds = {} if seed_globals else {"random_seed": None, "numpy_random_seed": None, "torch_random_seed": None}
    with quiet_git():
        results = lm_eval.simple_evaluate(model=lm, tasks=specs, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, log_samples=False, bootstrap_iters=bootstrap_iters,
                                          **seeds)
    if results is None:  # simple_evaluate's answer on processes other than its rank 0: shard's is 0 on all
        raise ShardError("lm-eval returned no results")
    return results


@contextlib.contextmanager
def quiet_git():
    """lm-eval records the working directory's git commit by running `git describe`, whose `fatal: not a
    git repository` (outside one) reached the console through the inherited stderr: the same question
    asked with git's stderr dropped, lm-eval's own fallback (reading .git) after it."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def commit() -> str | None:
        try:
            return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return get_commit_from_path(os.getcwd())

    asked, evaluator.get_git_commit_hash = evaluator.get_git_commit_hash, commit
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = asked


def scores(results: dict) -> dict[str, float]:
    """Each task's metrics as `eval/<task>/<metric>` (a filter other than "none" as `<metric>_<filter>`),
    finite numbers only and no standard errors: what the training loop logs."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # "acc,none"; "alias", "sample_len" are not metrics
            if not comma or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                out[f"eval/{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out


def table(results: dict) -> str:
    """lm-eval's own table of the results (and of the groups', where tasks form groups)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def write_results(results: dict, path: Path) -> Path:
    """The results as lm-eval writes them (values JSON cannot hold, as strings)."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return path


def data_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a run reads its data with; bytes for synthetic data into a 256-token model."""
    from shard.data.sources import SYNTHETIC, data_source
    from shard.data.tokenizers import BYTE_VOCAB, ByteTokenizer, load_tokenizer

    source = data_source(cfg)
    if source.kind != SYNTHETIC:
        return load_tokenizer(source.tokenizer)
    if cfg.model.vocab_size == BYTE_VOCAB:
        return ByteTokenizer()
    raise ShardError(f"eval.harness_tasks need text: synthetic data into a {cfg.model.vocab_size}-token model has "
                     "no tokenizer (train on a corpus, or a 256-token model reads bytes)")


class HarnessEvaluator:
    """The training loop's benchmark tasks (eval.harness_tasks): `__call__(params, router_bias)` ->
    `eval/<task>/<metric>` scores of the current parameters on the run's layout, in batches of
    data.batch rows of up to data.seq_len tokens. Built before the first step, so an unknown task or
    a file that does not parse stops the run before it trains."""

    def __init__(self, cfg, run):
        self.cfg, self.best_metric = cfg, cfg.checkpoint.best_metric
        self.tasks = task_specs(list(cfg.eval.harness_tasks))
        self.lm = ShardLM(Scorer(run.spec, run.layout, None, cfg.data.batch), data_tokenizer(cfg), cfg.data.seq_len)

    def __call__(self, params, router_bias=None) -> dict[str, float]:
        self.lm.scorer.params, self.lm.scorer.router_bias = params, router_bias
        self.lm._generator = None  # it holds the parameters it was built with
        limit = self.cfg.eval.harness_limit or None
        found = scores(run_tasks(self.lm, self.tasks, limit=limit, bootstrap_iters=0, seed_globals=False))
        if self.best_metric.startswith("eval/") and self.best_metric not in found:
            raise ShardError(f"checkpoint.best_metric {self.best_metric} is not among the tasks' scores: "
                             f"{', '.join(sorted(found)) or 'none'}")
        return found
