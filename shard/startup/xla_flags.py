"""XLA flags shard applies on GPUs, and the deterministic mode. Flags must be in XLA_FLAGS before JAX
starts; a flag the user already set is never overridden. XLA aborts at start-up on a flag it does not
know, and XLA renames and retires flags between releases, so a flag of these that the installed XLA
does not know is left out, with a warning (`unknown_to_xla`); a test checks that every flag here exists
in the jaxlib the tests run on."""

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from shard.paths import read_json_or_empty

# flag -> (value, what it does). Applied on GPU only.
GPU_PRESET: dict[str, tuple[str, str]] = {
    "--xla_gpu_enable_latency_hiding_scheduler": (
        "true", "schedule collectives early and overlap them with independent compute"),
    "--xla_gpu_enable_highest_priority_async_stream": (
        "true", "run collectives on a high-priority stream so they are not starved by compute"),
    "--xla_gpu_enable_pipelined_all_gather": (
        "true", "FSDP: prefetch the next scanned layer's weights while this layer computes"),
    "--xla_gpu_enable_pipelined_reduce_scatter": (
        "true", "FSDP: reduce-scatter a layer's gradients while the previous layer's backward runs"),
    "--xla_gpu_enable_pipelined_all_reduce": (
        "true", "DP/TP: overlap a scanned layer's all-reduce with the next layer's compute"),
    "--xla_gpu_enable_while_loop_double_buffering": (
        "true", "double-buffer loop-carried values of the layer scan so the pipelining above applies"),
    "--xla_gpu_all_reduce_combine_threshold_bytes": (
        "134217728", "combine small all-reduces up to 128 MiB: fewer, larger NCCL calls"),
    "--xla_gpu_all_gather_combine_threshold_bytes": (
        "134217728", "combine small all-gathers up to 128 MiB"),
    "--xla_gpu_reduce_scatter_combine_threshold_bytes": (
        "134217728", "combine small reduce-scatters up to 128 MiB"),
    "--xla_gpu_threshold_for_windowed_einsum_mib": (
        "0", "tensor parallel: collective matmul (decompose all-gather/reduce-scatter + matmul into "
             "overlapped chunks) for every size"),
    "--xla_gpu_multi_streamed_windowed_einsum": (
        "true", "run the collective-matmul chunks on several streams"),
}

DETERMINISTIC: dict[str, tuple[str, str]] = {
    "--xla_gpu_deterministic_ops": ("true", "deterministic reductions and scatter on GPU"),
    "--xla_gpu_exclude_nondeterministic_ops": ("true", "refuse ops that have no deterministic kernel"),
}


def gpu_expected() -> bool:
    """Whether JAX will start on NVIDIA GPUs, guessed without starting it (installed CUDA plugin)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu"))
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def added_flags(current: str, *, gpu: bool, gpu_preset: bool, deterministic: bool) -> list[str]:
    """The preset flags ("--name=value") the user has not set themselves in `current` XLA_FLAGS."""
    wanted: dict[str, tuple[str, str]] = {}
    if gpu and gpu_preset:
        wanted |= GPU_PRESET
    if deterministic:
        wanted |= DETERMINISTIC
    present = set(re.findall(r"(--[\w]+)=?", current))
    return [f"{flag}={value}" for flag, (value, _) in wanted.items() if flag not in present]


def merged_flags(current: str, *, gpu: bool, gpu_preset: bool, deterministic: bool) -> str:
    """`current` XLA_FLAGS plus the preset flags the user has not set themselves."""
    extra = added_flags(current, gpu=gpu, gpu_preset=gpu_preset, deterministic=deterministic)
    return " ".join([current.strip(), *extra]).strip()


def apply(*, gpu_preset: bool, deterministic: bool) -> list[str]:
    """Set XLA_FLAGS for this process (call before JAX starts); returns the names of the preset flags
    left out because the installed XLA does not know them. A GPU run asked to be deterministic whose
    XLA lacks a deterministic flag is refused: without it the run would not be."""
    current = os.environ.get("XLA_FLAGS", "")
    gpu = gpu_expected()
    kept, unknown = known_flags(added_flags(current, gpu=gpu, gpu_preset=gpu_preset, deterministic=deterministic))
    missing = [f for f in unknown if f in DETERMINISTIC]
    if gpu and missing:
        from shard.errors import ShardError

        raise ShardError(f"xla.deterministic: this XLA does not know {', '.join(missing)}, so the run would "
                         "not be deterministic; use a jaxlib that has it, or set xla.deterministic=false")
    os.environ["XLA_FLAGS"] = " ".join([current.strip(), *kept]).strip()
    return unknown


def known_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """(the flags the installed XLA knows, the names of those it does not), by `unknown_to_xla`."""
    unknown = unknown_to_xla(flags) if flags else []
    return [f for f in flags if f.split("=")[0] not in unknown], unknown


_PROBE = "import jax; jax.devices('cpu')"


def unknown_to_xla(flags: list[str]) -> list[str]:
    """The names of the flags ("--name=value") the installed XLA does not know. XLA parses its flags,
    GPU ones included, when a backend starts, and aborts naming every unknown one: JAX is started on CPU
    in a subprocess with these flags (about a second), once per jaxlib version and set of flags; the
    answer is kept in the user's cache folder (not kept where there is none, or where the XLA's version
    is unknown). [] when the probe fails for another reason or takes over a minute: the run itself will
    then say what is wrong."""
    versions = _versions()
    key = hashlib.sha256(" ".join([versions, *sorted(flags)]).encode()).hexdigest()[:16]
    path = _cache_file() if versions else None
    known = read_json_or_empty(path) if path else {}
    if isinstance(known.get(key), list):
        return known[key]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    try:
        # -P: a `jax/` in the working folder is never imported in place of the installed one
        r = subprocess.run([sys.executable, "-P", "-c", _PROBE], env=env, capture_output=True, text=True,
                           timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", r.stderr)
    if r.returncode and not found:
        return []
    unknown = sorted({f.split("=")[0] for f in found.group(1).split()}) if found else []
    if path:
        _write_json(path, known | {key: unknown})
    return unknown


def _versions() -> str:
    """The installed XLA, as the packages that bring it."""
    out = []
    for package in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{package}=={importlib.metadata.version(package)}")
    return " ".join(out)


def _cache_file() -> Path | None:
    """$XDG_CACHE_HOME/shard/xla_flags.json (~/.cache by default); None without a home folder."""
    root = os.environ.get("XDG_CACHE_HOME")
    if not root:
        try:
            root = Path.home() / ".cache"
        except (RuntimeError, KeyError):  # no HOME, and a user id with no passwd entry
            return None
    return Path(root) / "shard" / "xla_flags.json"


def _write_json(path: Path, doc: dict) -> None:
    """Whole or not at all (several processes of one job may probe at once); a cache that can't be
    written (its clean-up included) only costs the next start its probe."""
    from shard.paths import write_text_atomic

    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(doc, indent=1))
