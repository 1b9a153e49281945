"""The training loop: steps from a prepared Run (shard.training.prepare) to cfg.steps, metrics, evaluation,
the divergence guard and checkpoint cadence. It reports to its observers (`shard.training.observer.Observer`)
and prints and writes nothing itself.
"""

import contextlib
import math
import statistics
import time

import jax

from shard.cluster import runtime
from shard.config.flops import hardware_flops_per_token, mfu_flops_per_token
from shard.config.train import GuardConfig, TrainConfig
from shard.errors import DivergenceError
from shard.hardware import FLOP_SHARE_ERROR, flop_shares
from shard.training.dpo import DPO_METRICS  # a DPO run's step metrics, copied into its records
from shard.training.grpo import GRPO_METRICS  # and a GRPO run's
from shard.training.observer import Observer
from shard.training.prepare import Run, prepare

# Steps dispatched ahead of the oldest one not yet finished. Enough to keep the devices fed between
# host syncs; unbounded (until --log-every), XLA:CPU's in-process collectives deadlocked with 8
# simulated devices on 2 cores ("Termination timeout ... only 6 of them arrived", then an abort).
MAX_STEPS_AHEAD = 2
# A MoE model's step metrics copied into its records (shard.training.step: expert_load_metrics).
MOE_METRICS = ("aux_loss", "router_z_loss", "expert_load_min", "expert_load_max", "expert_load_cv", "tokens_dropped",
               "expert_rows_sent", "mtp_loss")  # and multi-token prediction's (model.mtp_depth)



def device_memory(run: Run) -> dict:
    """Memory in use and peak on the busiest local device: measured where the backend reports it,
    else XLA's estimate for the compiled step, labelled as such."""
    stats = [d.memory_stats() for d in run.mesh.local_devices]
    if all(stats):
        return {"mem_in_use_bytes": max(s.get("bytes_in_use", 0) for s in stats),
                "mem_peak_bytes": max(s.get("peak_bytes_in_use", 0) for s in stats), "mem_source": "device"}
    m = run.compiled_memory
    if not m:  # the MPI bridge compiles on the first call: no estimate to give
        return {}
    return {"mem_in_use_bytes": m["arguments"], "mem_peak_bytes": m["total"], "mem_source": "compiled"}


def first_divergence(steps: list[tuple[int, dict]], history: list[float], guard: GuardConfig):
    """(step, reason) of the first step whose loss or grad norm is not finite or spikes, else None.
    `history` holds earlier steps' grad norms and is extended with the healthy ones."""
    for step, m in steps:
        loss, gnorm = float(m["loss"]), float(m["grad_norm"])
        if not math.isfinite(loss) or not math.isfinite(gnorm):
            return step, f"loss {loss} and gradient norm {gnorm} at step {step}"
        if guard.spike_factor > 0 and len(history) >= 10:
            ref = statistics.median(history[-50:])
            if gnorm > guard.spike_factor * ref:
                return step, (f"gradient norm {gnorm:.3g} at step {step} is over {guard.spike_factor:g}x "
                              f"the median of earlier steps ({ref:.3g})")
        history.append(gnorm)
    return None


def train(cfg: TrainConfig, *, devices=None, observers=(), run: Run | None = None) -> list[dict]:
    """Run from run.start_step to cfg.steps (or until an observer asks to stop); returns the logged
    records (also sent to the observers)."""
    for o in observers:
        if not isinstance(o, Observer):
            raise TypeError(f"{type(o).__name__} is not a shard.training.observer.Observer: subclass it")
    run = run or prepare(cfg, devices)
    evaluator = harness = None
    waiting = []  # started and not yet ended, in the order they end: last started first
    try:
        for o in observers:
            o.on_start(run)
            waiting.append(o)
        if cfg.eval.every:
            from shard.training.evaluate import Evaluator

            evaluator = Evaluator(cfg, run)
        if cfg.eval.harness_tasks:
            from shard.training.harness import HarnessEvaluator  # lm-eval, or a one-line error

            harness = HarnessEvaluator(cfg, run)
        records = _StepLoop(cfg, run, observers, evaluator, harness).run_steps()
        while waiting:
            waiting[-1].on_end(records)
            waiting.pop()
    finally:
        if evaluator:
            evaluator.close()
        for o in reversed(waiting):  # an error: the run did not end as planned
            with contextlib.suppress(Exception):  # the error under way is the one to report
                o.on_abort()
    return records


class _StepLoop:
    """The steps of one `train` call, and what they carry from step to step: the metrics still on device,
    the guard's grad norms and skipped steps, and the time and tokens since the last record."""

    def __init__(self, cfg: TrainConfig, run: Run, observers, evaluator, harness=None):
        self.cfg, self.run, self.observers, self.evaluator, self.harness = cfg, run, observers, evaluator, harness
        self.flops_per_token = mfu_flops_per_token(cfg.model, cfg.data.seq_len)
        # what runs per input position, padding included
        self.hardware_flops_per_position = hardware_flops_per_token(cfg.model, cfg.data.seq_len,
                                                                    run.mesh.devices.flat[0].platform)
        self.mesh_name = ",".join(f"{k}={v}" for k, v in run.mesh.shape.items())
        self.records: list[dict] = []
        self.start = self.last_time = time.perf_counter()
        self.last_step = run.at_step
        self.saving_s = 0.0  # time the host spent saving since the last record: not step time
        self.pending: list[tuple[int, dict]] = []  # metrics of the steps not yet checked, still on device
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.peak_refuted = False  # a FLOP share above 1 was seen: the peak is no peak
        self.filled_since = run.stream.filled_tokens  # real (not padding) input tokens made into batches so far
        # asked between eval batches too, where every process evaluates (should_stop is a collective of all)
        self.eval_stop = None
        if evaluator is not None and len(evaluator.group.ranks) == runtime.context().size:
            self.eval_stop = self._asked_to_stop

    def run_steps(self) -> list[dict]:
        """From the step the run is at to cfg.steps, or until an observer asks to stop; the records."""
        cfg, run, observers = self.cfg, self.run, self.observers
        state = run.state
        for i in range(run.at_step + 1, cfg.steps + 1):
            state, metrics = self._dispatch(i, state)
            stopping = self._asked_to_stop()
            final = stopping or i == cfg.steps
            for o in observers:
                o.on_step(i, (state, metrics))
            evaluating = self.evaluator is not None and (i % cfg.eval.every == 0 or i == cfg.steps)
            every = cfg.eval.harness_every
            benchmarking = self.harness is not None and (i == cfg.steps or bool(every) and i % every == 0)
            # an evaluation is logged when it runs
            logging = i % cfg.log_every == 0 or final or evaluating or benchmarking
            saving = self._saves(i, final)
            if logging or saving:
                steps = self._sync(i)
            if logging:
                self._log(i, steps, state, evaluating, benchmarking)
                # a signal came during it: stop here (the last step ends as it would have, its save the final one)
                if evaluating and self.evaluator.interrupted and not stopping and i < cfg.steps:
                    stopping = final = True
                    saving = self._saves(i, final)
            before = time.perf_counter()
            for o in observers:
                o.on_state(i, state, run.stream.position, metrics, final)
            if saving:  # nor is a checkpoint's blocking part (the device waits: its steps were synced above)
                self.saving_s += time.perf_counter() - before
            if stopping:
                run.stopped_at = i if i < cfg.steps else None  # a signal in the last step: the run is done
                break
        return self.records

    def _dispatch(self, i: int, state):
        """Start step i on the next batch, without waiting for it unless MAX_STEPS_AHEAD are in flight."""
        run = self.run
        batch = run.stream.next()
        state, metrics = run.step_fn(state, batch)
        run.state, run.trained_to = state, i  # kept current: a call that is interrupted leaves a usable run
        self.pending.append((i, metrics))
        if len(self.pending) > MAX_STEPS_AHEAD:  # wait for an older step: a bounded queue (see MAX_STEPS_AHEAD)
            jax.block_until_ready(self.pending[-MAX_STEPS_AHEAD - 1][1])
        return state, metrics

    def _asked_to_stop(self) -> bool:
        # Every observer (a list, not a short-circuit): with several processes each one's should_stop()
        # takes part in a collective that all processes must reach.
        return any([o.should_stop() for o in self.observers])  # noqa: C419

    def _saves(self, step: int, final: bool) -> bool:
        return any([o.saves_at(step, final) for o in self.observers])  # noqa: C419

    def _sync(self, i: int) -> list[tuple[int, dict]]:
        """The pending steps' metrics, on the host and checked by the guard (step i synced): a divergence
        stops the run, with its step's record kept; skipped steps are counted."""
        steps = jax.device_get(self.pending)
        self.pending = []
        if self.cfg.guard.action == "stop":
            bad = first_divergence(steps, self.grad_norms, self.cfg.guard)
            if bad:
                self.run.state = None  # diverged: nothing downstream may save it
                # the step that diverged stays on record (metrics.jsonl)
                self._publish(self._record(bad[0], dict(steps)[bad[0]], synced=i) | {"diverged": bad[1]})
                raise DivergenceError(f"training diverged: {bad[1]}; stopped, earlier checkpoints are kept")
        else:
            self.skipped += int(sum(m["skipped"] for _, m in steps))
        return steps

    def _log(self, i: int, steps: list[tuple[int, dict]], state, evaluating: bool, benchmarking: bool) -> None:
        """Step i's record, with the evaluations that run at it, to the observers; the next record's
        interval starts here."""
        record = self._record(i, steps[-1][1])
        if self.cfg.guard.action == "skip":
            record["skipped_steps"] = self.skipped
        if evaluating:
            # None on processes outside the eval set
            eval_loss = self.evaluator(state["params"], self.eval_stop, state.get("router_bias"))
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
        if benchmarking:  # eval/<task>/<metric>
            record.update(self.harness(state["params"], state.get("router_bias")))
        self._publish(record)
        self.last_time, self.last_step, self.saving_s = time.perf_counter(), i, 0.0  # evaluation is not step time
        self.filled_since = self.run.stream.filled_tokens

    def _record(self, step: int, values: dict, synced: int | None = None) -> dict:
        """One step's record: its metrics, and speed and memory over the steps since the last record
        (`synced`: the step the host waited for, when later than `step`: the time runs to it)."""
        run = self.run
        now = time.perf_counter()
        elapsed, timed = now - self.last_time - self.saving_s, (synced or step) - self.last_step
        # input tokens per step timed, a packed batch's padding not counted (the stream made exactly the
        # batches of the steps up to the one synced)
        per_step = (run.stream.filled_tokens - self.filled_since) / max(1, timed)
        record = {
            "step": step,
            "loss": float(values["loss"]),
            "grad_norm": float(values["grad_norm"]),
            "lr": float(values["lr"]),
            "tokens_per_s": timed * per_step / elapsed,
            "step_time_s": elapsed / timed,
            "tokens_seen": run.tokens_seen(step),
            "time_s": now - self.start,
            "start_step": run.start_step,  # this start's: 0, or the checkpoint it resumed from
            "mesh": self.mesh_name,  # this start's layout: shard report marks where it changed
            **device_memory(run),
        }
        if run.peak_flops and not self.peak_refuted:  # model and hardware FLOP shares, never above 1
            positions_per_s = timed * self.cfg.data.batch * self.cfg.data.seq_len / elapsed
            try:
                record["mfu"], record["hfu"] = flop_shares(record["tokens_per_s"] * self.flops_per_token,
                                                           positions_per_s * self.hardware_flops_per_position,
                                                           run.devices_in_all * run.peak_flops)
            except AssertionError as e:  # a wrong peak (observe.peak_tflops, a cache measured under load)
                # must not stop a run: said once in its record, and no share is reported from then on
                self.peak_refuted = True
                record[FLOP_SHARE_ERROR] = f"{e}; MFU and HFU are left out of this run's records"
        if run.pipeline:
            record["pipeline_bubble"] = run.pipeline["bubble"]
        if run.stream.packed:  # the share of the batches' input positions that hold a token
            record["packing"] = per_step / (self.cfg.data.batch * self.cfg.data.seq_len)
        for key in MOE_METRICS + DPO_METRICS + GRPO_METRICS + ("max_logit",):  # MoE's, DPO's, GRPO's, QK-clip's
            if key in values:
                record[key] = float(values[key])
        each_reward = ("reward/", "reward_std/")  # GRPO's, each reward's mean and std
        record |= {k: float(v) for k, v in values.items() if k.startswith(each_reward)}
        if "completions" in values:  # and a few of its completions (completions.jsonl)
            record["completions"] = values["completions"]
        return record

    def _publish(self, record: dict) -> None:
        self.records.append(record)
        for o in self.observers:
            o.on_log(record)
