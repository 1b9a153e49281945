"""Held-out loss (eval.path, or data.path's held-out tail: shard.data.batches.eval_samples) on a process set:
the trainer's own use of `shard.cluster.process_sets.process_set`.

The first `eval.processes` processes form the set "eval"; each member evaluates its block of every
held-out batch on its own mesh and the set sums (loss, tokens) over its members only, while the other
processes go straight on (with the MPI bridge every process holds the whole model, so any subset can
evaluate). With one global mesh (--cross-host xla) the set is every process.
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from shard.cluster import process_sets, runtime
from shard.config.train import TrainConfig
from shard.data.batches import BatchStream, eval_samples
from shard.errors import ShardError
from shard.training.state import StateSpec, place_router_bias, state_spec
from shard.training.step import batch_sharding, make_eval_step


def eval_processes(cfg: TrainConfig, ctx: runtime.Context) -> int:
    """How many processes evaluate, or a ShardError when the job can't have that eval set (checked by
    `prepare` before anything compiles)."""
    n = cfg.eval.processes or ctx.size
    if n > ctx.size:
        raise ShardError(f"eval.processes is {n} but the job has {ctx.size} process(es)")
    if n < ctx.size and ctx.mode != runtime.MPI:
        raise ShardError("evaluation on fewer than all processes (eval.processes) needs --cross-host mpi: "
                         "with one global mesh every process holds part of the model")
    return n


def eval_rows(cfg: TrainConfig, n: int, layout) -> int:
    """Rows of each held-out batch that each of `n` eval processes takes under the MPI bridge, checked
    against its local mesh's data-parallel devices (by `prepare`, before anything compiles)."""
    if cfg.data.batch % n:
        raise ShardError(f"global batch {cfg.data.batch} does not divide over {n} eval processes (eval.processes)")
    rows, dp = cfg.data.batch // n, layout.degree("batch")
    if rows % dp:
        raise ShardError(f"each of {n} eval processes takes {rows} rows of a global batch of {cfg.data.batch}, "
                         f"which do not divide over its {dp} data-parallel devices; use a batch that is a "
                         f"multiple of {n * dp}, or another eval.processes")
    return rows


class Evaluator:
    """`__call__(params, stop=None, router_bias=None) -> eval loss` on members of the eval set (None
    elsewhere, and when `stop` ended it: then `interrupted`); `router_bias`: the state's, for a MoE run
    that balances with one, so its evaluations choose experts as its steps do."""

    def __init__(self, cfg: TrainConfig, run):
        self.interrupted = False
        ctx = runtime.context()
        n = eval_processes(cfg, ctx)
        self.cfg = cfg
        self.group = process_sets.process_set(range(n), name="eval")
        self.step = make_eval_step(run.spec, run.layout)
        dataset = run.eval_data if run.eval_data is not None else eval_samples(cfg)
        if ctx.mode == runtime.MPI:
            rows = eval_rows(cfg, n, run.layout)
            offset = self.group.rank * rows if self.group.includes() else 0
            self.stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(run.layout),
                                      offset=offset, rows=rows)
        else:
            self.stream = BatchStream(dataset, cfg.data.batch, cfg.data.seq_len, batch_sharding(run.layout))

    def __call__(self, params, stop=None, router_bias=None) -> float | None:
        """The eval loss; None outside the eval set, and when `stop()` (asked before each batch, on every
        process of the set) turned true: a SIGTERM must not wait for a long evaluation."""
        self.interrupted = False
        if not self.group.includes():
            return None

        self.stream.position = 0  # the same held-out batches every time
        totals = summed_loss(self.step, params, self.stream, self.cfg.eval.batches, stop, router_bias)
        if totals is None:
            self.interrupted = True
            return None
        if runtime.context().mode == runtime.MPI:
            totals = self.group.allreduce(totals)  # members only
        return float(totals[0] / max(totals[1], 1.0))

    def close(self) -> None:
        self.group.destroy()


def summed_loss(step, params, stream: BatchStream, batches: int, stop=None, router_bias=None) -> np.ndarray | None:
    """[summed next-token loss, tokens] over the next `batches` batches of `stream` (float64); None when
    `stop()`, asked before each batch, turned true. `router_bias`: as `make_eval_step` takes it."""
    import jax

    totals = np.zeros(2, np.float64)
    for _ in range(batches):
        if stop is not None and stop():
            return None
        nll, count = step(params, stream.next(), router_bias)
        totals += [float(jax.device_get(nll)), float(jax.device_get(count))]
    return totals


def held_out_source(saved: TrainConfig | None, data: str | None, checkpoint: str,
                    since: int | None = None) -> tuple[TrainConfig, str]:
    """(config whose eval_samples are the data to evaluate, a description) for `shard eval`: --data, or
    else the held-out data the run evaluated on (eval.path, or data.path's held-out tail). A run that
    never held any out trained on all of data.path, so that is refused rather than scored. `since`:
    the step since which the checkpoint's run has held that tail out (None: not recorded)."""
    from shard.data.sources import SYNTHETIC
    from shard.data.batches import held_out_share

    if data is not None:
        if saved is None:
            saved = TrainConfig()
        return dataclasses.replace(saved, eval=dataclasses.replace(saved.eval, path=data)), f"--data {data}"
    if saved is None:
        raise ShardError(f"{checkpoint} holds no run config that names held-out data (a Hugging Face folder): "
                         "give --data")
    if saved.eval.path:
        return saved, f"the run's eval.path {saved.eval.path}"
    if saved.data.path == SYNTHETIC:
        return saved, "fresh synthetic tokens (the run trained on synthetic data)"
    if not held_out_share(saved):
        raise ShardError(f"the run in {checkpoint} trained on all of its data (it had no eval.every, so nothing "
                         "was held out): give --data with text it never saw")
    tail = f"the last {saved.eval.holdout:.0%} of the run's data"
    if since is None:  # a checkpoint from before shard recorded it
        return saved, f"{tail}, held out by the run's evaluations"
    if since:
        return saved, (f"{tail}, held out from training only since step {since}: a resume changed what is held "
                       "out, so the steps before it may have read these windows")
    return saved, f"{tail}, held out from training"


def evaluate_checkpoint(cfg: TrainConfig, layout, params: dict, place: Callable[[dict, StateSpec], dict],
                        batches: int, source: str, notice: Callable[[str], None] = lambda message: None,
                        router_bias: np.ndarray | None = None) -> dict:
    """`shard eval`'s figures: the loss and perplexity of `params` (a checkpoint's, on the host) over
    `batches` global batches of cfg's held-out samples (cfg.data.batch x cfg.data.seq_len), scored on
    `layout`; `source` describes that data. Data too short for them scores fewer batches, each window
    once, and `notice` says so. `place` puts host params into a spec's shardings
    (shard.run.weights.place). `router_bias`: the checkpoint's MoE balancing bias (host, (L, E)), if it
    saved one: experts are chosen by it, as in training."""
    batch, seq = cfg.data.batch, cfg.data.seq_len
    samples = eval_samples(cfg)
    if samples.windows is not None and samples.windows < batch:
        raise ShardError(f"the data holds {samples.windows} window(s) of {seq + 1} tokens, fewer than one batch of "
                         f"{batch}: give a smaller --batch (a multiple of the mesh's {layout.degree('batch')} "
                         "data-parallel devices) or a shorter --seq")
    if samples.windows is not None and samples.windows < batches * batch:  # none scored twice
        batches = samples.windows // batch
        notice(f"the data holds {samples.windows} window(s) of {seq + 1} tokens: scoring {batches} batch(es) of "
               f"{batch}")
    # only the params are read: the optimizer, whatever the run's, is the default one
    spec = state_spec(cfg.model, TrainConfig().optimizer, 1, layout)
    stream = BatchStream(samples, batch, seq, batch_sharding(layout))
    bias = place_router_bias(router_bias, spec)
    nll, tokens = summed_loss(make_eval_step(spec, layout), place(params, spec), stream, batches, router_bias=bias)
    loss = float(nll / max(tokens, 1.0))
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens),
            "batches": batches, "batch": batch, "seq_len": seq, "data": source}
