"""A run on disk: checkpoints, the run directory, resuming, agreement across processes, weights and Hugging Face folders."""
