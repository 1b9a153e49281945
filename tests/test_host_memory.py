"""shard asks glibc for transparent huge pages by re-executing itself once with the tunable set."""

import os
import subprocess
import sys

import pytest

from shard.startup import host_memory
from shard.startup.host_memory import TUNABLE, tunables_with_huge_pages


def test_the_tunable_is_added_only_where_it_helps():
    assert tunables_with_huge_pages("", (2, 36), "madvise") == f"{TUNABLE}=1"
    assert tunables_with_huge_pages("glibc.pthread.rseq=0", (2, 35), "madvise") == f"glibc.pthread.rseq=0:{TUNABLE}=1"
    assert tunables_with_huge_pages(f"{TUNABLE}=0", (2, 36), "madvise") is None  # the user chose
    assert tunables_with_huge_pages("", (2, 34), "madvise") is None  # no such tunable before 2.35
    assert tunables_with_huge_pages("", (), "madvise") is None  # not glibc
    assert tunables_with_huge_pages("", (2, 36), "always") is None  # huge pages already on
    assert tunables_with_huge_pages("", (2, 36), "never") is None


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_memory.thp_mode(str(f)) == "madvise"
    assert host_memory.thp_mode(str(tmp_path / "missing")) == ""


REPORT = ("from shard.startup.host_memory import reexec_with_huge_pages as r; r(); import os, sys; "
          "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), *sys.argv[1:])")


def _run(env) -> list[str]:
    """What the child prints: its PID, GLIBC_TUNABLES and its arguments; the PID must be the one started."""
    p = subprocess.Popen([sys.executable, "-c", REPORT, "keep", "these"], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    fields = out.split()
    assert fields[0] == str(p.pid) and fields[2:] == ["keep", "these"], out
    return fields


@pytest.mark.skipif(tunables_with_huge_pages("", host_memory.glibc_version(), host_memory.thp_mode()) is None,
                    reason="this machine's glibc or kernel gives no huge pages for malloc")
def test_the_process_restarts_itself_once_with_the_tunable():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert _run(env)[1] == f"{TUNABLE}=1"
    assert _run({**env, "GLIBC_TUNABLES": f"{TUNABLE}=0"})[1] == f"{TUNABLE}=0"  # the user's choice stays


def test_the_command_restarts_before_the_cli_imports():
    """The entry point restarts with huge pages before typer and rich are imported: restarting after
    them imported them twice (0.14 s of every launch)."""
    code = "import sys; import shard.cli.entry; print(sorted(m for m in ('typer', 'rich', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["shard"] == "shard.cli.entry:main"


def test_release_freed_memory_hands_held_heap_back_to_the_kernel():
    """Freed blocks below the top of malloc's heap stay in the RSS until malloc_trim returns them."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # 128 MiB in blocks below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)  # touched: in the RSS
    pin = libc.malloc(64 << 10)  # above them, so freeing them leaves no free top for malloc to trim itself
    for b in blocks:
        libc.free(b)
    held = _rss_kib()
    assert host_memory.release_freed_memory()
    released = held - _rss_kib()
    libc.free(pin)
    assert released > 64 << 10, released  # at least half of the 128 MiB (in KiB)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_bf16_matmul_cpus_are_read_from_the_cpu_flags(tmp_path):
    from shard.hardware import cpu_has_bf16_matmul

    flags = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {}\n\n"
    (tmp_path / "bf16").write_text(flags.format("avx512_bf16"))
    (tmp_path / "amx").write_text(flags.format("amx_tile amx_bf16"))
    (tmp_path / "plain").write_text(flags.format("avx512vnni"))
    assert cpu_has_bf16_matmul(str(tmp_path / "bf16")) and cpu_has_bf16_matmul(str(tmp_path / "amx"))
    assert not cpu_has_bf16_matmul(str(tmp_path / "plain"))
    assert not cpu_has_bf16_matmul(str(tmp_path / "missing"))  # macOS, Windows: float32 stays the default
