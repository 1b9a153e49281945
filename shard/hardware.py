"""Accelerators' figures for the cost model and MFU: the shipped table (shard/hardware.toml), a user's
own file of the same form, and the entry that matches a JAX device."""

import functools
import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from shard import tomlfiles
from shard.config.values import is_positive_number
from shard.errors import ShardError

_HW_KEYS = {"description", "aliases", "bf16_tflops", "matmul_tflops", "fp8_tflops", "hbm_gib", "hbm_gbps",
            "intra_node_gbps", "inter_node_gbps", "devices_per_node"}
_OPTIONAL_KEYS = {"description", "aliases", "matmul_tflops", "fp8_tflops"}
# The share of the bf16 peak a large matmul reaches where an entry gives no matmul_tflops: the H200's
# measured 790 of 989 TFLOP/s
MATMUL_SHARE = 0.8
# x86 flags of a CPU that multiplies bfloat16 in hardware. Where XLA:CPU was measured with one (AMD EPYC,
# AVX-512 BF16), bfloat16 with full remat ran the reference config as fast as float32 without remat in
# about 20% less memory; other CPUs (ARM's BF16 too) were not measured and keep float32.
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}


@dataclass(frozen=True)
class Hardware:
    """One accelerator's figures (per device; bandwidths one direction, GB/s = 1e9 bytes/s)."""

    name: str
    description: str
    bf16_tflops: float
    hbm_gib: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    devices_per_node: int
    aliases: tuple[str, ...] = ()
    matmul_tflops: float | None = None  # what a large bf16 matmul reaches
    fp8_tflops: float | None = None  # dense FP8 peak (datasheet); None: no FP8 tensor cores (A100) or not known

    @property
    def achieved_tflops(self) -> float:
        """The bf16 rate the planner's compute time is taken at: the entry's matmul rate, else
        MATMUL_SHARE of the peak (MFU stays against the peak, as `shard train` reports it; at the peak
        itself a compute-bound plan read MFU 100%)."""
        return self.matmul_tflops or MATMUL_SHARE * self.bf16_tflops

    @property
    def achieved_fp8_tflops(self) -> float | None:
        """The rate the planner takes FP8 matmuls at: the FP8 peak times the share of the bf16 peak a bf16
        matmul reaches (no FP8 matmul has been measured here); None without an `fp8_tflops`."""
        return self.fp8_tflops * self.achieved_tflops / self.bf16_tflops if self.fp8_tflops else None


def load_hardware(extra: str | Path | None = None) -> dict[str, Hardware]:
    """The shipped table (shard/hardware.toml), amended by a user's TOML file of the same form."""
    docs = [("shard/hardware.toml", resources.files("shard").joinpath("hardware.toml").read_text())]
    if extra:
        docs.append((str(extra), tomlfiles.read_text(extra, f"hardware file {extra}")))
    table: dict[str, Hardware] = {}
    for label, text in docs:
        doc = tomlfiles.parse(text, f"hardware file {label}")
        for name, entry in doc.items():
            table[name.lower()] = _hardware_entry(label, name, entry)
    return table


def _hardware_entry(label: str, name: str, entry) -> Hardware:
    """One [name] table of a hardware file, checked: every figure a positive number."""
    where = f"hardware file {label}: [{name}]" if name.strip() else f"hardware file {label}: a table with an empty name"
    if not name.strip():
        raise ShardError(f"{where}; name each accelerator, e.g. [h100]")
    if not isinstance(entry, dict):
        raise ShardError(f"{where} must be a table (a key outside any [section]?)")
    unknown = set(entry) - _HW_KEYS
    missing = _HW_KEYS - _OPTIONAL_KEYS - set(entry)
    if unknown or missing:
        what = f"unknown key(s) {', '.join(sorted(unknown))}" if unknown else \
            f"missing key(s) {', '.join(sorted(missing))}"
        raise ShardError(f"{where} has {what}")
    figures = {k: entry[k] for k in _HW_KEYS - {"description", "aliases"} if k in entry}
    for key, value in sorted(figures.items()):
        if not is_positive_number(value) or (key == "devices_per_node" and not isinstance(value, int)):
            kind = "a positive whole number" if key == "devices_per_node" else "a positive number"
            raise ShardError(f"{where}: {key} must be {kind}, got {value!r}")
    if figures.get("matmul_tflops", 0) > figures["bf16_tflops"]:
        raise ShardError(f"{where}: matmul_tflops ({figures['matmul_tflops']:g}) is above the peak bf16_tflops "
                         f"({figures['bf16_tflops']:g})")
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ShardError(f"{where}: aliases must be a list of names")
    return Hardware(name=name.lower(), description=str(entry.get("description", "")),
                    aliases=tuple(a.lower() for a in aliases), **figures)


def hardware_for_device(device_kind: str, platform: str, table: dict[str, Hardware] | None = None) -> Hardware | None:
    """The table entry for a JAX device (`device.device_kind`, e.g. "NVIDIA H100 80GB HBM3"), or None.
    An entry matches when its model name (h100, a100, ...) is in the kind and so is its variant, where it
    names one: a memory size (a100-40g: "40gb") or a form (h100-pcie, h200-nvl). The more specific entry
    wins, so an H100 PCIe is not taken for the SXM part. CPU devices match the `cpu` entry."""
    table = table or load_hardware()
    if platform == "cpu":
        return table.get("cpu")
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    best = None
    for hw in table.values():
        model, _, variant = hw.name.partition("-")
        if re.fullmatch(r"\d+gb?", variant):
            variant = variant.rstrip("gb") + "gb"
        matches = model in kind and variant.replace("-", "") in kind
        if matches and (best is None or len(hw.name) > len(best.name)):
            best = hw
    return best


def find_hardware(name: str, table: dict[str, Hardware]) -> Hardware:
    key = name.lower()
    for hw in table.values():
        if key == hw.name or key in hw.aliases:
            return hw
    raise ShardError(f"unknown hardware {name!r} (known: {', '.join(sorted(table))}; add your own with "
                     "--hardware-file)")


@functools.cache
def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has bfloat16 matmul instructions (AVX-512 BF16 or AMX), from the flags
    in `cpuinfo`; False where the file is absent or unreadable (macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    return any(_BF16_CPU_FLAGS & set(line.partition(":")[2].split())
               for line in text.splitlines() if line.startswith("flags"))


# Platforms whose XLA backend lowers `ragged-all-to-all` (XLA:CPU's thunk emitter rejects the opcode:
# jax-ml/jax#34755); dropless routing's tokens move by it there (shard.parallel.ragged)
RAGGED_ALL_TO_ALL_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})


def lowers_ragged_all_to_all(platform: str) -> bool:
    return platform in RAGGED_ALL_TO_ALL_PLATFORMS


# /proc/cpuinfo flags that decide a CPU's matmul rate, printed beside its measured peak
CPU_MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_summary(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """This machine's CPU model, its matmul flags (CPU_MATMUL_FLAGS it has) and the cores this process
    may use; empty model and flags where `cpuinfo` is unreadable."""
    try:
        lines = Path(cpuinfo).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    model = next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "")
    flags = set().union(*(line.partition(":")[2].split() for line in lines if line.startswith("flags")))
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "flags": [f for f in CPU_MATMUL_FLAGS if f in flags], "threads": threads}


PEAK_METHOD = "xla16-writes-f32"  # how benchmarks/peak.py times XLA's 16-bit matmuls (written as float32)


def peak_cache_path() -> Path:
    """Where benchmarks/peak.py keeps this machine's measured matmul peak and shard reads it: one file per
    machine (host name, CPU model and usable cores) under $XDG_CACHE_HOME/shard (~/.cache/shard), or the
    file $SHARD_PEAK_FILE names (the tests name one that is absent: no peak, whatever the machine has)."""
    if os.environ.get("SHARD_PEAK_FILE"):
        return Path(os.environ["SHARD_PEAK_FILE"])
    cpu = cpu_summary()
    # PEAK_METHOD in the key: a cache measured another way (16-bit matmuls that wrote 16 bits) is not read
    key = hashlib.sha256(f"{socket.gethostname()}|{cpu['model']}|{cpu['threads']}|{PEAK_METHOD}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shard"
    return root / f"peak-{socket.gethostname()}-{key}.json"


def measured_peak(dtype: str, path: Path | None = None) -> float | None:
    """This machine's best measured matmul FLOP/s in `dtype` (float32, bfloat16), all cores together, from
    benchmarks/peak.py's cache; None where it was not measured here (or the file is unreadable)."""
    try:
        doc = json.loads((path or peak_cache_path()).read_text())
        value = doc["peak_flops"][dtype]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if is_positive_number(value) else None


FLOP_SHARE_ERROR = "flop_share_error"  # a run's record: why its FLOP shares stopped (a peak that is none)


def flop_shares(model_flops_s: float, hardware_flops_s: float, peak_flops_s: float) -> tuple[float, float]:
    """(model FLOP share = MFU, hardware FLOP share) of a peak. Neither can pass 1: a share above it means
    the peak is no peak (measured on a loaded machine, or the wrong dtype's) or a FLOP count is wrong,
    and is raised as that bug with both figures rather than reported."""
    shares = model_flops_s / peak_flops_s, hardware_flops_s / peak_flops_s
    for name, flops, share in (("model", model_flops_s, shares[0]), ("hardware", hardware_flops_s, shares[1])):
        if share > 1.0:
            raise AssertionError(f"{name} FLOP share {share:.1%} is above 100%: {flops / 1e9:,.1f} GFLOP/s done "
                                 f"against a peak of {peak_flops_s / 1e9:,.1f} GFLOP/s; the peak is not this "
                                 "machine's (measure it again: python benchmarks/peak.py) or the FLOP count "
                                 "(shard.config.model) is wrong")
    return shares
