"""Scoring token sequences with a model on a mesh, for benchmark harnesses (shard.training.harness):
the summed log-probability of each sequence's last tokens and whether greedy decoding gives them.

Sequences are sorted longest first (as lm-eval's Hugging Face backend sorts them), cut into fixed
global batches of `batch` rows and padded on the right to a bucket length (powers of two), so few
tokens are wasted and few programs compile. The parameters and the batch are laid out by the
training rules: a model too big for one device scores with FSDP and tensor parallelism as it trained.
Right padding needs no attention mask: a causal model's positions never see the ones after them.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import LENGTH
from shard.errors import ShardError
from shard.models import llama
from shard.sharding.rules import Layout, activation_layout
from shard.training.state import StateSpec
from shard.training.step import batch_sharding, context_order

SHORTEST_BUCKET = 16


def bucket_length(n: int, multiple: int = 1) -> int:
    """The padded length of a batch whose longest row has `n` tokens: the next power of two (at least
    SHORTEST_BUCKET), rounded up to a multiple of the devices the sequence splits over."""
    length = max(SHORTEST_BUCKET, 1 << max(n - 1, 0).bit_length())
    return -(-length // multiple) * multiple


def longest_first(rows: Sequence[Sequence[int]]) -> list[int]:
    """The order rows are scored in: longest first, ties by their tokens (lm-eval's hf backend's order)."""
    return sorted(range(len(rows)), key=lambda i: (-len(rows[i]), tuple(rows[i])))


class Scorer:
    """`score(rows)`: for each row (token ids, and how many of its last tokens to score), the summed
    log-probability of those tokens given the ones before them and whether each is the model's greedy
    choice. `params`: placed in `spec`'s shardings; `router_bias`: as make_eval_step takes it."""

    def __init__(self, spec: StateSpec, layout: Layout, params: dict, batch: int, router_bias=None):
        dp = layout.degree("batch")
        if batch < 1 or batch % dp:
            raise ShardError(f"the harness batch {batch} does not divide over the mesh's {dp} data-parallel "
                             f"devices: use a multiple of {dp}")
        self.spec, self.layout, self.batch = spec, layout, batch
        self.params, self.router_bias = params, router_bias  # replaced between evaluations in training
        self.length_ways = layout.degree(LENGTH)
        self.shapes: set[int] = set()  # bucket lengths compiled so far
        self.padded_tokens = self.real_tokens = 0  # what the batches held, and how much of it was a request's
        cfg = spec.model

        def score(params, batch, router_bias):
            with activation_layout(layout):
                batch, zigzag = context_order(batch, layout, cfg)  # a per-row sum: order does not matter
                logits_btv = llama.forward(cfg, params, batch["inputs"], zigzag, router_bias=router_bias)[0]
                logits_btv = logits_btv.astype(jnp.float32)
                target_bt = jnp.take_along_axis(logits_btv, batch["targets"][..., None], axis=-1)[..., 0]
                logp_bt = target_bt - jax.nn.logsumexp(logits_btv, axis=-1)
                greedy_bt = jnp.argmax(logits_btv, axis=-1) == batch["targets"]
                scored_bt = batch["mask"] > 0
                return (jnp.sum(jnp.where(scored_bt, logp_bt, 0.0), axis=1),
                        jnp.all(greedy_bt | ~scored_bt, axis=1))

        replicated = NamedSharding(layout.mesh, PartitionSpec())
        self._data = batch_sharding(layout)
        self._score = jax.jit(score, in_shardings=(spec.shardings["params"], self._data, replicated),
                              out_shardings=replicated)

    def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """Each row's (summed log-probability of its last `n` tokens, all of them greedy), in the rows'
        order. A row holds at least two tokens and 1 <= n < its length."""
        tokens = [r[0] for r in rows]
        for t, n in rows:
            if not 1 <= n < len(t):
                raise ValueError(f"a row of {len(t)} tokens cannot score its last {n}")
        order = longest_first(tokens)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch):
            chunk = order[start:start + self.batch]
            logp, greedy = self._score_batch([rows[i] for i in chunk])
            for i, lp, g in zip(chunk, logp, greedy):
                out[i] = (float(lp), bool(g))
        return out

    def _score_batch(self, rows) -> tuple[np.ndarray, np.ndarray]:
        length = bucket_length(max(len(t) - 1 for t, _ in rows), self.length_ways)
        inputs = np.zeros((self.batch, length), np.int32)  # rows past the requests: padding, scored nowhere
        targets = np.zeros((self.batch, length), np.int32)
        mask = np.zeros((self.batch, length), np.float32)
        for r, (t, n) in enumerate(rows):
            t = np.asarray(t, np.int32)
            inputs[r, :len(t) - 1], targets[r, :len(t) - 1] = t[:-1], t[1:]
            mask[r, len(t) - 1 - n:len(t) - 1] = 1.0
            self.real_tokens += len(t) - 1
        self.padded_tokens += self.batch * length
        self.shapes.add(length)
        # every process holds the same requests: each places the blocks its own devices hold
        batch = {k: jax.make_array_from_callback(v.shape, self._data, lambda index, v=v: v[index])
                 for k, v in (("inputs", inputs), ("targets", targets), ("mask", mask))}
        logp, greedy = jax.device_get(self._score(self.params, batch, self.router_bias))
        return logp[:len(rows)], greedy[:len(rows)]
