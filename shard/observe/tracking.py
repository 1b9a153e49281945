"""Weights & Biases tracking (`--wandb PROJECT`, `[tracking]`): the resolved config, the start-up summary,
every logged metric and `shard report`'s plots. wandb is an optional extra (`./install.sh wandb`)."""

import math
import secrets
import string
import tempfile
import tomllib
from pathlib import Path

from shard.config import TrainConfig, to_toml
from shard.errors import ShardError
from shard.paths import WANDB_ID
from shard.training.observer import Observer


def require_wandb():
    """The wandb module, or the one-line error that says how to install it (checked before compiling)."""
    try:
        import wandb
    except ImportError:
        raise ShardError("--wandb needs wandb: ./install.sh wandb") from None
    return wandb


def run_id(run_dir: Path) -> str:
    """The run dir's W&B run id: made and saved at its first start, read back by every later one, so a
    resume continues the same W&B run."""
    path = run_dir / WANDB_ID
    if path.is_file() and (saved := path.read_text().strip()):
        return saved
    made = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # wandb's own form
    path.write_text(made + "\n")
    return made


class WandbTracker(Observer):
    """Logs to one W&B run per run dir; only the main process makes one."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self._wandb = require_wandb()
        self._run = None  # made when the run starts

    def on_start(self, run) -> None:
        t = self.cfg.tracking
        try:
            self._run = self._wandb.init(
                project=t.project, entity=t.entity or None, name=t.name or None, tags=list(t.tags) or None,
                mode=t.mode or None, dir=str(self.run_dir), config=tomllib.loads(to_toml(self.cfg)),
                id=run_id(self.run_dir), resume="allow")
        except Exception as e:  # noqa: BLE001 - not logged in, no network, a bad entity: wandb's own errors
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ShardError(f"W&B could not start a run for project {t.project!r} ({first}); log in with "
                             "`wandb login`, or set tracking.mode=offline (WANDB_MODE=offline) and "
                             "`wandb sync` later") from None
        self._run.summary.update(startup_summary(self.cfg, run))

    def on_log(self, record: dict) -> None:
        # bools are not metrics; a non-finite value (a skipped step's NaN loss) is left out, as TensorBoard does
        values = {k: v for k, v in record.items()
                  if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        self._run.log(values, step=record["step"])

    def on_end(self, records: list[dict]) -> None:
        if records:
            self._log_plots()
        self._run.finish()

    def on_abort(self) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1)

    def _log_plots(self) -> None:
        """`shard report`'s plots of this run, as images (matplotlib is a core dependency)."""
        from shard.observe.report import load_run, plot

        with tempfile.TemporaryDirectory() as out:
            pngs = plot([load_run(str(self.run_dir))], Path(out))
            self._run.log({f"report/{p.stem}": self._wandb.Image(str(p)) for p in pngs})


def startup_summary(cfg: TrainConfig, run) -> dict:
    """What the console's start-up line says, as W&B summary keys: the mesh, its layout, the model's size,
    the compiled step's per-device memory."""
    summary = {
        "mesh/shape": dict(run.mesh.shape), "mesh/devices": run.devices_in_all,
        "mesh/platform": run.mesh.devices.flat[0].platform,
        "layout/rules": {k: list(v) for k, v in run.layout.rules.items()},
        "layout/param_rules": {k: list(v) for k, v in run.layout.param_rules.items()},
        "model/params": cfg.model.num_params(),
        "start_step": run.start_step,
    }
    summary.update({f"memory/compiled_{k}_bytes": v for k, v in run.compiled_memory.items()})
    if run.compile_s is not None:
        summary["compile_s"] = run.compile_s
    if run.pipeline:
        summary["pipeline"] = dict(run.pipeline)
    return summary
