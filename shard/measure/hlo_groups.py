"""A collective's replica groups, in any of the three printed forms (`{{0,1},{2,3}}`, the iota form
`[2,4]<=[8]T(1,0)`, and the mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`), turned into the names
of the mesh axes along which a group's devices differ."""

from __future__ import annotations

import math
import re

import numpy as np

from shard.measure.hlo_text import Instr


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Device groups (indices into the flattened mesh) of a collective, or None if unreadable."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))? "
                  r"\{([^}]*)\}", attrs)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        dims = [int(s) for _, s in names]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None) if m.group(2)
               else np.arange(math.prod(dims)))
        ids = ids.reshape(dims)
        reduce_axes = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
        keep = [i for i in range(len(dims)) if i not in reduce_axes]
        size = math.prod(dims[i] for i in reduce_axes)
        return ids.transpose(keep + reduce_axes).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", attrs)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return groups or [list(range(n_devices))]
    return permute_pairs(attrs)


def permute_pairs(attrs: str) -> list[list[int]] | None:
    """A collective-permute's (source, target) pairs, or None where none are printed."""
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else None


def group_axes(groups: list[list[int]], axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """Mesh axes along which the devices of a group differ (the union over all groups)."""
    varying: set[int] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.array(g), axis_sizes)).T
        varying |= {i for i in range(len(axis_sizes)) if len(set(coords[:, i])) > 1}
    return tuple(axis_names[i] for i in sorted(varying))


def groups_of(ins: Instr, n_devices: int) -> list[list[int]]:
    """The collective's replica groups (none given: one group of every device)."""
    groups = replica_groups(ins.attrs, n_devices)
    return [list(range(n_devices))] if groups is None else groups


def devices_over(axes: tuple[str, ...], axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]) -> int:
    """Devices in a group spanning these mesh axes."""
    return math.prod(axis_sizes[axis_names.index(a)] for a in axes)
