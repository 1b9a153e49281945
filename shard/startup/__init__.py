"""What must happen before or as JAX starts: simulated CPU devices, XLA flags, the compile cache, huge pages, lazy imports."""
