"""orbax's CheckpointManager over a checkpoints folder, as shard keeps it (the newest K, optionally the
best by a metric; async saves; the `state` and `meta` items), and the saved state's array metadata read
through it. Shared by the train state's checkpoints (shard.run.checkpoint) and the weights read alone
(shard.run.stored)."""

import contextlib
import math
from pathlib import Path

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from shard.config.train import CheckpointConfig
from shard.run.checkpoint_files import META, STATE
from shard.run.orbax_quiet import absl_quiet, configure_orbax


def orbax_manager(directory: Path, cfg: CheckpointConfig | None = None, read_only: bool = False,
                  write_concurrent_gb: float | None = None, barrier_prefix: str | None = None) -> ocp.CheckpointManager:
    """The manager of `directory` (made at its first save), keeping what `cfg` says; `write_concurrent_gb`
    bounds the bytes orbax writes at once (None: its default). `barrier_prefix` names its barriers between
    the processes apart from another manager's whose saves may be under way at the same time."""
    cfg = cfg or CheckpointConfig()
    keep: list = [policies.LatestN(n=cfg.keep)]
    ranking = {}
    if cfg.best_metric:
        metric, worst = cfg.best_metric, math.inf if cfg.best_mode == "min" else -math.inf

        def value(metrics: dict) -> float:
            """A save's value; one without (a stop between evaluations, or one ranked by another metric
            before a resume changed it) ranks last, so it is kept only while among the newest."""
            return metrics.get(metric, worst)

        # orbax writes a save's metrics to disk only with a best_fn; without them a restart forgot
        # which checkpoint was best. The preservation policy below still decides what is kept.
        ranking = {"best_fn": value, "best_mode": cfg.best_mode}
        # BestN keeps the last n after sorting; reverse for "min" puts the smallest last. Checkpoints
        # with no metrics on disk at all (written before shard recorded them) are kept.
        keep.append(policies.BestN(get_metric_fn=value, reverse=cfg.best_mode == "min", n=cfg.keep_best))
    configure_orbax()
    limit = {} if write_concurrent_gb is None else {"save_concurrent_gb": write_concurrent_gb}
    handlers = {STATE: ocp.StandardCheckpointHandler(**limit), META: ocp.JsonCheckpointHandler()}
    with absl_quiet() if read_only else contextlib.nullcontext():  # orbax's notes on read-only use
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep), enable_async_checkpointing=True,
            # No directory until the first save: a start that fails before it leaves no trace.
            create=False, read_only=read_only, **ranking,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=barrier_prefix),
        )
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def stored_tree(manager: ocp.CheckpointManager, step: int) -> dict:
    """The saved state's tree of orbax ArrayMetadata (shape, dtype, sharding) at `step`, read from the files."""
    stored = manager.item_metadata(step)[STATE]
    tree = getattr(stored, "tree", stored)
    if not isinstance(tree, dict) or "params" not in tree:  # orbax reads a missing _METADATA as None
        raise ValueError(f"its {STATE}/ holds no description of its arrays (is {STATE}/_METADATA missing?)")
    return tree
