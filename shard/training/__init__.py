"""Training: the sharded state, the compiled step, the loop and its observers, evaluation and generation."""
