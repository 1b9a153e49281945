"""Checks gpu.sh runs before the benchmarks: a mismatch between shard and the image's packages found
here costs seconds, not the device lease. Each check runs in a fresh process.

    python3 benchmarks/preflight.py SITE   # SITE: the --target dir on PYTHONPATH that holds shard

1. `import flax.nnx`. flax up to 0.12.9 subclasses `jax.experimental.hijax.HiPrimitive`, which jax 0.11.2
   renamed `HiPrim` (google/flax#5596, fixed in flax 0.12.10). If that is the failure, SITE gets a
   sitecustomize.py that restores the old name (importing jax at every start, so JAX_PLATFORMS set
   inside a script comes too late: the GPU benchmarks don't), and the import is tried again.
2. XLA_FLAGS with shard's GPU preset and deterministic flags. XLA aborts at start-up on a flag it doesn't
   know; shard leaves such a flag out (shard.startup.xla_flags.known_flags): they are named, and JAX must
   start with the rest.
Exit status 1 when a check still fails.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

HIPRIM_ALIAS = '''\
# written by benchmarks/preflight.py: this image's flax predates its jax (google/flax#5596)
import jax.experimental.hijax as _hijax
if not hasattr(_hijax, "HiPrimitive") and hasattr(_hijax, "HiPrim"):
    _hijax.HiPrimitive = _hijax.HiPrim
'''


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-P", "-c", code], env=dict(os.environ, **env), capture_output=True,
                              text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(code, 124, "", "timed out after 120 s")


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def check_flax(site: Path) -> bool:
    r = python("import flax.nnx")
    if r.returncode == 0:
        return True
    print(f"preflight: import flax.nnx failed: {last_line(r.stderr)}", flush=True)
    if "HiPrimitive" not in r.stderr:
        return False
    # the image's own sitecustomize, if any, would be shadowed by SITE's: run it from ours
    found = python("import importlib.util as u; s = u.find_spec('sitecustomize'); print(s.origin if s else '')")
    chained = f"exec(open({found.stdout.strip()!r}).read())\n" if found.stdout.strip() else ""
    (site / "sitecustomize.py").write_text(HIPRIM_ALIAS + chained)
    r = python("import flax.nnx")
    print(f"preflight: with HiPrimitive = HiPrim: {'imports' if r.returncode == 0 else last_line(r.stderr)}",
          flush=True)
    return r.returncode == 0


def check_flags() -> bool:
    """shard leaves out a preset flag this XLA does not know (shard.startup.xla_flags.apply): named here, and
    JAX must start with the rest."""
    from shard.startup import xla_flags  # SITE's copy: it is first on sys.path

    kept, unknown = xla_flags.known_flags(xla_flags.added_flags("", gpu=True, gpu_preset=True, deterministic=True))
    if unknown:
        print(f"preflight: this XLA doesn't know {', '.join(unknown)}; shard leaves them out", flush=True)
    r = python("import jax; jax.devices()", XLA_FLAGS=" ".join(kept))
    if r.returncode:
        print(f"preflight: JAX fails to start with shard's XLA flags: {last_line(r.stderr)}", flush=True)
    return r.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="the --target dir on PYTHONPATH that holds shard (gpu.sh's /tmp/site)")
    site = ap.parse_args().site
    ok = check_flax(site) and check_flags()
    r = python("import importlib.metadata as m, jax\n"
               "print(*(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', "
               "'numpy')), sep=', ')\nprint(jax.devices())")
    print(r.stdout.strip() or last_line(r.stderr), flush=True)
    print(f"preflight: {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
