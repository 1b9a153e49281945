"""Data mixtures: `--data mix.toml` names sources with weights (and optional epoch caps).

    [[sources]]
    path = "web/"          # anything data.path takes: a store, files, a folder, a glob
    weight = 3
    [[sources]]
    path = "code.jsonl"
    weight = 1
    epochs = 2             # read at most twice; its share then goes to the others

Which source the global sample i comes from is a pure function of (seed, i): samples go in blocks of
`BLOCK`; each block gives every source its share of the block's slots (largest remainder), in an order
shuffled by (seed, block). A source's k-th sample is its own k-th (its own seeded order), so the
stream is the same on any mesh or process count and resumes exactly. A source whose epochs are capped
leaves the mixture after the block in which it reaches its cap (caps are honoured to within a block);
once every source is spent, the mixture has no more samples.
"""

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.data.files import is_glob
from shard.data.samples import join_rows
from shard.errors import ShardError

BLOCK = 1024


@dataclass(frozen=True)
class MixtureEntry:
    path: str
    weight: float
    epochs: float = 0.0  # 0: no cap


def is_mixture(path: str) -> bool:
    return path.endswith(".toml") and Path(path).is_file()


def read_mixture(path: str) -> list[MixtureEntry]:
    """The sources a mixture file names; paths relative to the file's folder. One line per problem."""
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ShardError(f"mixture {path}: cannot read it ({e})") from None
    sources = doc.get("sources")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, dict) for s in sources):
        raise ShardError(f"mixture {path} names no sources: give [[sources]] tables with path and weight")
    unknown = set(doc) - {"sources"}
    if unknown:
        raise ShardError(f"mixture {path}: unknown key {sorted(unknown)[0]!r} (known: sources)")
    entries = []
    for n, s in enumerate(sources, 1):
        where = f"mixture {path}, source {n}"
        extra = set(s) - {"path", "weight", "epochs"}
        if extra:
            raise ShardError(f"{where}: unknown key {sorted(extra)[0]!r} (known: path, weight, epochs)")
        if not isinstance(s.get("path"), str) or not s["path"]:
            raise ShardError(f"{where}: needs a path")
        weight, epochs = s.get("weight"), s.get("epochs", 0)
        if not _number(weight) or not weight > 0 or math.isinf(weight):
            raise ShardError(f"{where} ({s['path']}): weight must be a finite number above 0, got {weight!r}")
        if not _number(epochs) or epochs < 0 or math.isinf(epochs):
            raise ShardError(f"{where} ({s['path']}): epochs must be a number above 0 (0: no cap), got {epochs!r}")
        p = s["path"]
        if p not in ("", "synthetic") and not Path(p).is_absolute():  # relative to the mixture's folder
            p = str((Path(path).parent / p).absolute())
        if p not in ("", "synthetic") and not is_glob(p) and not Path(p).exists():
            raise ShardError(f"{where}: {p} does not exist")
        if is_mixture(p):
            raise ShardError(f"{where}: {p} is a mixture itself; name its sources here instead")
        same = [k for k, e in enumerate(entries, 1) if _same_source(e.path, p)]
        if same:  # its documents would be drawn twice as often as its weight says, from two orders
            raise ShardError(f"{where}: {p} is source {same[0]} already; give it one entry, with the weight of both")
        entries.append(MixtureEntry(p, float(weight), float(epochs)))
    return entries


def _same_source(a: str, b: str) -> bool:
    """Whether two of a mixture's paths name the same thing (a link, `./x` and `x` alike)."""
    if a == b:
        return True
    exists = a not in ("", "synthetic") and b not in ("", "synthetic") and Path(a).exists() and Path(b).exists()
    return exists and Path(a).resolve() == Path(b).resolve()


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Slots per block for each weight (0 for none): proportional, by largest remainder, summing to `block`."""
    w = np.asarray(weights, np.float64)
    w = w / w.max()  # weights are relative: two of 1e308 are two halves, not an overflow to inf
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    short = block - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


@dataclass(frozen=True)
class Phase:
    first_block: int
    last_block: int | None  # exclusive; None: forever
    counts: np.ndarray  # slots per block for every source
    before: np.ndarray  # samples each source gave before this phase


def phases(weights: list[float], caps: list[int | None], block: int = BLOCK) -> list[Phase]:
    """The mixture's phases: between two of them a capped source runs out and leaves."""
    active = [True] * len(weights)
    used = np.zeros(len(weights), np.int64)
    out, first = [], 0
    while any(active):
        counts = block_counts([w if a else 0.0 for w, a in zip(weights, active)], block)
        # blocks until a capped active source reaches its cap
        runs = [-(-(caps[s] - used[s]) // counts[s]) for s in range(len(weights))
                if active[s] and caps[s] is not None and counts[s] > 0]
        if not runs:
            out.append(Phase(first, None, counts, used.copy()))
            return out
        n = max(1, min(runs))
        out.append(Phase(first, first + n, counts, used.copy()))
        used += counts * n
        first += n
        for s in range(len(weights)):
            if active[s] and caps[s] is not None and used[s] >= caps[s]:
                active[s] = False
    return out


class MixtureSamples:
    """Samples drawn from several sources (each a shard.data.samples.Samples) by the mixture's rule."""

    def __init__(self, parts: list, weights: list[float], caps: list[int | None], seed: int, labels: list[str],
                 origin=None):
        self.parts, self.weights, self.seed, self.labels = parts, weights, seed, labels
        self.origin = origin  # the shard.data.sources.DataSource read (None: made by hand)
        self.phases = phases(weights, caps)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def total(self) -> int | None:
        """Samples the mixture holds (None: unbounded)."""
        last = self.phases[-1]
        return None if last.last_block is None else last.last_block * BLOCK

    @property
    def packed(self) -> bool:
        return all(p.packed for p in self.parts)

    @property
    def windows(self) -> int | None:
        sizes = [p.windows for p in self.parts]
        return None if None in sizes else sum(sizes)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """For block b: the source of each slot, and the source's sample index of each slot."""
        if b not in self._blocks:
            phase = next((p for p in self.phases if p.last_block is None or b < p.last_block), None)
            if phase is None:
                raise ShardError(f"the data mixture is spent after {self.total:,} samples (every source reached "
                                 "its epochs cap): raise a cap, or train fewer steps")
            slots = np.repeat(np.arange(len(self.parts)), phase.counts)
            rng = np.random.default_rng([self.seed, b])
            source = slots[rng.permutation(slots.size)]
            rank = np.zeros(source.size, np.int64)
            for s in range(len(self.parts)):
                here = source == s
                rank[here] = np.arange(here.sum())
            index = phase.before[source] + (b - phase.first_block) * phase.counts[source] + rank
            if len(self._blocks) > 8:
                self._blocks.clear()
            self._blocks[b] = (source, index)
        return self._blocks[b]

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's own sample index) of global samples [start, stop)."""
        i = np.arange(start, stop)
        source, index = np.empty(i.size, np.int64), np.empty(i.size, np.int64)
        for b in np.unique(i // BLOCK).tolist():
            here = i // BLOCK == b
            s, k = self._block(b)
            source[here], index[here] = s[i[here] % BLOCK], k[i[here] % BLOCK]
        return source, index

    def rows(self, start: int, stop: int):
        source, index = self.locate(start, stop)
        pieces = [None] * (stop - start)
        out = []
        for s in np.unique(source).tolist():
            where = np.flatnonzero(source == s)
            out.append((where, self.parts[s].rows_at(index[where])))
        return join_rows(out, stop - start) if out else pieces

    def filled(self, start: int, stop: int) -> int:
        source, index = self.locate(start, stop)
        return sum(self.parts[s].filled_at(index[source == s]) for s in np.unique(source).tolist())

    def shares(self) -> list[float]:
        """Each source's share of the first phase's samples."""
        counts = self.phases[0].counts
        return (counts / counts.sum()).tolist()
