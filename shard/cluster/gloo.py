"""gloo, the cross-process collectives of JAX on CPU: where it listens, and its connection banner.

JAX makes gloo's collectives when its CPU backend starts (after the job has joined), by
`jaxlib._jax.make_gloo_tcp_collectives(distributed_client)`, which listens on the address the host's
name resolves to. `listen_on` has it listen where shard.cluster.listen decided instead. gloo prints
`[Gloo] Rank N is connected to M peer ranks. ...` on C++'s stdout for every group of devices it
connects; `drop_banner` keeps those lines out of the output (C++'s stdout: Python's own goes around it).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import threading

# gloo's banner, written from one thread per local device: interleaved, a line can hold fragments of several
BANNER = re.compile(rb"(?:\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :"
                    rb"|\d+|\s+)*")


def listen_on(host: str | None = None, iface: str | None = None) -> None:
    """Have the gloo collectives JAX makes from now on listen on `host` (an address) or `iface`."""
    if host is None and iface is None:
        return
    from jaxlib import _jax

    make = getattr(_jax, "make_gloo_tcp_collectives", None)
    if make is None:
        return
    original = getattr(make, "shard_original", make)

    def made_here(distributed_client, hostname=None, interface=None):
        return original(distributed_client=distributed_client, hostname=hostname or host,
                        interface=interface or iface)

    made_here.shard_original = original
    _jax.make_gloo_tcp_collectives = made_here


_filtering: list[int] = []  # the original stdout's descriptor, once drop_banner runs


def drop_banner() -> None:
    """From now on, lines that gloo's C++ code writes to stdout (file descriptor 1) pass through a
    thread that drops its banner; Python's own output goes straight to the original stdout, so that an
    exit without flushing (os._exit) loses none of it. Once per process."""
    if _filtering:
        return
    sys.stdout.flush()
    original = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    _filtering.append(original)
    old = sys.stdout
    sys.stdout = io.TextIOWrapper(io.FileIO(original, "w", closefd=False), encoding=getattr(old, "encoding", None),
                                  errors=getattr(old, "errors", None), line_buffering=True,
                                  write_through=getattr(old, "write_through", False))

    def forward() -> None:
        with contextlib.suppress(OSError), os.fdopen(read, "rb", buffering=0) as lines:
            pending = b""
            while chunk := lines.read(65536):
                pending += chunk
                *whole, pending = pending.split(b"\n")
                kept = b"".join(line + b"\n" for line in whole if not BANNER.fullmatch(line))
                if kept:
                    os.write(original, kept)
            if pending and not BANNER.fullmatch(pending):
                os.write(original, pending)

    threading.Thread(target=forward, name="shard-gloo-banner", daemon=True).start()
