"""Document packing (`data.packing = "packed"`): whole documents fitted into rows of seq_len + 1
tokens, with segment ids and positions that restart per document, so attention never crosses a
document boundary and RoPE positions count from each document's start.

The plan is computed once from the documents' lengths alone, in their stored order, so it is the same
on every host; the rows are then shuffled per epoch like windows (shard.data.batches), so a row is a
pure function of the seed and the global sample index.

- A document longer than a row is cut into pieces of seq_len + 1 tokens that overlap by one (as windows
  do), so every next-token target in it is trained exactly once; each piece is a segment of its own.
- Full pieces take a row each. The others are placed first-fit among the last `OPEN_ROWS` rows still
  open (a new row when none has room; when too many are open, the fullest is closed). A document of
  one token (no target) is left out.
"""

from dataclasses import dataclass

import numpy as np

OPEN_ROWS = 64


@dataclass(frozen=True)
class PackPlan:
    """Rows as runs of pieces: row r holds pieces row_starts[r]..row_starts[r+1]-1, each piece a
    (start in the token stream, length) pair, in the order they sit in the row."""

    piece_start: np.ndarray  # int64
    piece_length: np.ndarray  # int64
    row_starts: np.ndarray  # int64, len rows + 1
    row_length: int  # seq_len + 1

    @property
    def rows(self) -> int:
        return len(self.row_starts) - 1

    def __post_init__(self):
        total = np.concatenate([[0], np.cumsum(self.piece_length)])  # tokens before each piece
        object.__setattr__(self, "row_filled", total[self.row_starts[1:]] - total[self.row_starts[:-1]])

    def filled(self, rows: np.ndarray) -> np.ndarray:
        """Tokens each row holds (the rest is padding)."""
        return self.row_filled[rows]

    @property
    def efficiency(self) -> float:
        """The share of the rows' input positions that hold a token (not padding)."""
        inputs = np.minimum(self.filled(np.arange(self.rows)), self.row_length - 1)
        return float(inputs.sum() / max(1, self.rows * (self.row_length - 1)))


def pieces(document_ends: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every piece, in document order: documents of up to seq_len + 1 tokens whole,
    longer ones cut every seq_len tokens (pieces overlap by one token); one-token documents left out."""
    ends = np.asarray(document_ends, np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    keep = lengths >= 2
    starts, lengths = starts[keep], lengths[keep]
    counts = np.maximum(1, -(-(lengths - 1) // seq_len))
    doc = np.repeat(np.arange(len(starts)), counts)
    index = np.arange(doc.size) - np.repeat(np.cumsum(counts) - counts, counts)  # piece number within its document
    piece_start = starts[doc] + index * seq_len
    piece_length = np.minimum(seq_len + 1, starts[doc] + lengths[doc] - piece_start)
    return piece_start, piece_length


def pack(document_ends: np.ndarray, seq_len: int, open_rows: int = OPEN_ROWS) -> PackPlan:
    """The packing plan of documents ending at `document_ends` (int64 offsets into the token stream)."""
    width = seq_len + 1
    starts, lengths = pieces(document_ends, seq_len)
    row_of = np.empty(len(starts), np.int64)
    rows = 0
    open_ids: list[int] = []  # open rows, oldest first
    free: list[int] = []
    for k, length in enumerate(lengths.tolist()):
        if length == width:
            row_of[k] = rows
            rows += 1
            continue
        for j, room in enumerate(free):
            if room >= length:
                row_of[k] = open_ids[j]
                free[j] = room - length
                if free[j] < 2:  # nothing with a target fits any more
                    del open_ids[j], free[j]
                break
        else:
            if len(open_ids) == open_rows:  # close the fullest
                j = free.index(min(free))
                del open_ids[j], free[j]
            row_of[k] = rows
            open_ids.append(rows)
            free.append(width - length)
            rows += 1
    order = np.argsort(row_of, kind="stable")  # pieces grouped by row, in the order they were placed
    row_starts = np.searchsorted(row_of[order], np.arange(rows + 1)).astype(np.int64)
    return PackPlan(starts[order], lengths[order], row_starts, width)


class PackedSource:
    """Random access to packed rows: `read(rows)` gives tokens (-1: padding), segment ids (1.. per piece
    within the row, 0: padding) and positions (0.. within each piece) as (n, seq_len + 1) int32 arrays."""

    def __init__(self, tokens, plan: PackPlan):
        self.tokens, self.plan = tokens, plan

    def __len__(self) -> int:
        return self.plan.rows

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        plan, width = self.plan, self.plan.row_length
        rows = np.asarray(rows, np.int64) % max(1, plan.rows)
        out = {k: np.zeros((len(rows), width), np.int32) for k in ("tokens", "segments", "positions")}
        out["tokens"][:] = -1
        for i, r in enumerate(rows.tolist()):
            at = 0
            for seg, p in enumerate(range(plan.row_starts[r], plan.row_starts[r + 1]), 1):
                start, length = int(plan.piece_start[p]), int(plan.piece_length[p])
                out["tokens"][i, at:at + length] = _slice(self.tokens, start, length)
                out["segments"][i, at:at + length] = seg
                out["positions"][i, at:at + length] = np.arange(length)
                at += length
        return out

    def filled(self, rows: np.ndarray) -> np.ndarray:
        return self.plan.filled(np.asarray(rows, np.int64) % max(1, self.plan.rows))


def _slice(tokens, start: int, length: int) -> np.ndarray:
    if hasattr(tokens, "ranges"):  # TokenParts: shards of a store
        return tokens.ranges(np.array([start]), length)[0]
    return np.asarray(tokens[start:start + length])


def packed_batch(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Packed rows -> the step's inputs: next-token inputs and targets, a loss mask that is 0 where the
    target is padding or belongs to the next segment, and the inputs' segment ids and positions."""
    tokens, seg = rows["tokens"], rows["segments"]
    mask = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(np.float32)
    return {"inputs": np.maximum(tokens[:, :-1], 0), "targets": np.maximum(tokens[:, 1:], 0), "mask": mask,
            "segment_ids": seg[:, :-1].copy(), "positions": rows["positions"][:, :-1].copy()}
