"""XLA flags shard applies on GPUs, and the deterministic mode. Flags must be in XLA_FLAGS before JAX
starts; a flag the user already set is never overridden. XLA aborts on unknown flags, so a test checks
that every flag here exists in the installed jaxlib."""

import importlib.util
import os
import re

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


def merged_flags(current: str, *, gpu: bool, gpu_preset: bool, deterministic: bool) -> str:
    """`current` XLA_FLAGS plus the preset flags the user has not set themselves."""
    wanted: dict[str, tuple[str, str]] = {}
    if gpu and gpu_preset:
        wanted |= GPU_PRESET
    if deterministic:
        wanted |= DETERMINISTIC
    present = set(re.findall(r"(--[\w]+)=?", current))
    extra = [f"{flag}={value}" for flag, (value, _) in wanted.items() if flag not in present]
    return " ".join([current.strip(), *extra]).strip()


def apply(*, gpu_preset: bool, deterministic: bool) -> None:
    """Set XLA_FLAGS for this process (call before JAX starts)."""
    os.environ["XLA_FLAGS"] = merged_flags(os.environ.get("XLA_FLAGS", ""), gpu=gpu_expected(),
                                           gpu_preset=gpu_preset, deterministic=deterministic)
