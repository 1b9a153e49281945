"""Transparent huge pages for host memory, asked of glibc when the `shard` command starts.

XLA:CPU allocates each step's temporaries afresh, one block per device of up to hundreds of MiB. glibc
serves blocks that large with mmap and unmaps them on free, so every step faults that memory in again
and the kernel zeroes it, 4 KiB at a time: on the CPU reference config (issue 9) a fifth of the step went
to the kernel. With glibc's `glibc.malloc.hugetlb=1` tunable (glibc >= 2.35) malloc asks for transparent
huge pages (madvise), 2 MiB at a time: 18x fewer page faults and +25-35% tokens/s there.

glibc reads its tunables once, when the process starts, so `shard` re-executes itself once with the
tunable added, before anything heavy is imported. A user who sets `glibc.malloc.hugetlb` in
GLIBC_TUNABLES (to 0 to keep glibc's default) is left alone, and so is a machine where it cannot help:
not Linux, an older glibc, or transparent huge pages set to `always` (already on) or `never` (off).

Compiling a step frees hundreds of MiB that malloc keeps in its arenas, counted in the process's RSS
until reused: `release_freed_memory` hands them back once the step is compiled.
"""

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str:
    """The kernel's transparent-huge-page mode (always | madvise | never), '' if unknown."""
    try:
        text = Path(path).read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def glibc_version() -> tuple[int, ...]:
    """(major, minor) of the running glibc, () for another C library."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return ()
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) if name == "glibc" else ()


def tunables_with_huge_pages(tunables: str, glibc: tuple[int, ...], thp: str) -> str | None:
    """GLIBC_TUNABLES with huge pages for malloc added, or None when that would change nothing: the user
    already chose, glibc is older than 2.35 (no such tunable), or the kernel's mode is not `madvise`."""
    if TUNABLE in tunables or glibc < (2, 35) or thp != "madvise":
        return None
    return f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"


def reexec_with_huge_pages() -> None:
    """Replace this process with itself plus the huge-page tunable, where that helps (see above). Same
    PID, arguments and environment otherwise, so launchers (mpiexec, srun) and signals are unaffected.
    Returns without doing anything once JAX is imported: only a fresh command may restart."""
    if not sys.platform.startswith("linux") or "jax" in sys.modules or getattr(sys, "frozen", False):
        return  # (a frozen app's argv does not re-run it)
    tunables = tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""), glibc_version(), thp_mode())
    if tunables is None:
        return
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], {**os.environ, "GLIBC_TUNABLES": tunables})
    except OSError:
        return  # cannot re-execute (an unusual interpreter setup): run as we are


def release_freed_memory() -> bool:
    """Give the memory malloc holds free back to the kernel (glibc's malloc_trim), once a large transient
    use is over: compiling a step leaves hundreds of MiB freed but held in malloc's arenas, which count
    in the process's RSS until reused (the CPU reference config on fsdp=8: peak RSS 1,999 MiB without,
    1,695 with). False where the C library has no malloc_trim (not glibc), or SHARD_RELEASE_FREED_MEMORY=0."""
    import ctypes

    if os.environ.get("SHARD_RELEASE_FREED_MEMORY", "1") == "0":
        return False

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
