"""Simulated CPU devices: XLA reads the host device count once, when JAX's backends start, so the
CLI must ask for it before anything initialises JAX."""

import os
import re

from shard.cluster import runtime

HOST_COUNT_FLAG = "--xla_force_host_platform_device_count"
_FLAG_RE = re.compile(re.escape(HOST_COUNT_FLAG) + r"=\d+")


def with_host_devices(flags: str, n: int) -> str:
    """XLA_FLAGS `flags` with the simulated CPU device count set to n (any other count removed)."""
    return f"{_FLAG_RE.sub('', flags).strip()} {HOST_COUNT_FLAG}={n}".strip()


def request_host_devices(n: int) -> bool:
    """Ask XLA's CPU platform for n devices; False when JAX has already started (too late to change)."""
    if runtime.jax_started():
        return False
    os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), n)
    return True
