"""A run as library calls, and what it leaves on disk: `run_training` does what `shard train` does;
`load_model` / `open_model` read weights from outside a run (a checkpoint or a Hugging Face folder) onto a
mesh; `held_out_loss` and `task_scores` are `shard eval`; `import_hf_folder` and `export_hf_folder` the
Hugging Face conversions; checkpoints, the run directory, resuming, agreement across processes beside them."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.run", {
    "run_training": "shard.run.training_run", "RunResult": "shard.run.training_run",
    "RunInterrupted": "shard.run.training_run",
    "load_model": "shard.run.inference", "open_model": "shard.run.inference", "start_jax": "shard.run.inference",
    "LoadedModel": "shard.run.inference",
    "held_out_loss": "shard.run.evaluation", "task_scores": "shard.run.evaluation",
    "import_hf_folder": "shard.run.hf_convert", "export_hf_folder": "shard.run.hf_convert",
    "Checkpoints": "shard.run.checkpoint", "SaveCheckpoints": "shard.run.checkpoint",
}, modules=("weights",))
