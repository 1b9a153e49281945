"""Sampling from a model on a mesh: prefill the prompt into a KV cache, then decode one token at a time.

The cache and the parameters are sharded by the same rules as training (batch replicated: one prompt
at a time), so a model too big for one device generates with tensor parallelism.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.errors import ShardError
from shard.config.model import ModelConfig
from shard.config.finetune import LoraConfig
from shard.models.llama import cache_axes, init_cache
from shard.models.lora import adapting
from shard.sharding.rules import Layout, activation_layout


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def validate(self) -> None:
        if not 0 <= self.temperature < math.inf or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ShardError("sampling needs temperature >= 0, top-k >= 0 and 0 < top-p <= 1")


def sample(logits_bv: jax.Array, key, s: Sampling) -> jax.Array:
    """One token per row: greedy at temperature 0, else softmax(logits / T) cut to top-k and top-p."""
    if s.temperature == 0:
        return jnp.argmax(logits_bv, axis=-1)
    # shifted to a maximum of 0 first (softmax doesn't change): a tiny T then sends the others to -inf
    # rather than every logit to +inf, where the first index, not the largest, would win
    logits_bv = (logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True)) / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits_bv, min(s.top_k, logits_bv.shape[-1]))[0][..., -1:]
        logits_bv = jnp.where(logits_bv < kth, -jnp.inf, logits_bv)
    if s.top_p < 1:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[..., ::-1]
        cum_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1)
        # the smallest logit still inside the nucleus (the top token always stays)
        cutoff = jnp.take_along_axis(sorted_bv, jnp.sum(cum_bv < s.top_p, axis=-1, keepdims=True), axis=-1)
        logits_bv = jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1)


def sample_with_logp(logits_bv: jax.Array, key, s: Sampling) -> tuple[jax.Array, jax.Array]:
    """`sample`'s tokens, and each one's log-probability under softmax(logits / T) (before top-k and
    top-p cut it, as the trainer computes it: GRPO's sampler log-probabilities)."""
    token_b = sample(logits_bv, key, s)
    logp_bv = jax.nn.log_softmax(logits_bv.astype(jnp.float32) / max(s.temperature, 1e-6), axis=-1)
    return token_b, jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]


def _token_ids(prompt) -> list[int]:
    """One prompt's token ids as Python ints; a batch of prompts, or anything else, is a one-line error."""
    try:
        ids = np.asarray(prompt)
    except ValueError:  # ragged: several prompts of different lengths
        ids = None
    if ids is None or ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ShardError("a prompt is one sequence of token ids; generate one prompt at a time")
    return [int(t) for t in ids]


class Generator:
    """Compiled prefill and decode for one model on one layout; `stream` yields tokens as they come.
    `router_bias` (L, E), placed (shard.training.state.place_router_bias): the balancing bias a MoE
    checkpoint chose its experts by in training (model.router_bias_update); None: by the scores alone.
    `lora`: the run's adapters config, where `params` hold adapters (GRPO samples with a LoRA run's own)."""

    def __init__(self, model_cfg: ModelConfig, graphdef, params: dict, layout: Layout, max_len: int,
                 router_bias: jax.Array | None = None, lora: LoraConfig | None = None):
        self.cfg, self.max_len, self.router_bias = model_cfg, max_len, router_bias
        # One prompt at a time, one token per decode step: the batch and the sequence are replicated (a
        # context-parallel split of a cache of any length would have to divide it); the other rules
        # (tensor parallel) apply.
        self.layout = Layout(layout.mesh, dict(layout.rules) | {"batch": (), "length": (), "res_length": ()},
                             layout.param_rules, layout.regex_rules)
        self.params = params
        axes = cache_axes(model_cfg)
        self.cache_sharding = {k: self.layout.sharding(axes[k], what="KV cache")
                               for k in jax.eval_shape(lambda: init_cache(model_cfg, 1, max_len))}
        replicated = NamedSharding(layout.mesh, PartitionSpec())

        def forward(params, tokens, cache, start, router_bias):
            with activation_layout(self.layout), adapting(lora, None):  # LoRA params: their term added
                logits, cache = nnx.merge(graphdef, params)(tokens, cache, start, router_bias)
            return logits[:, -1], cache

        self._forward = jax.jit(forward, out_shardings=(replicated, self.cache_sharding), donate_argnums=2)
        self._sample = jax.jit(sample, static_argnums=2)
        self._sample_logp = jax.jit(sample_with_logp, static_argnums=2)
        self._repeat = jax.jit(lambda cache, n: jax.tree.map(lambda x: jnp.repeat(x, n, axis=1), cache),
                               static_argnums=1, out_shardings=self.cache_sharding)

    def _checked(self, prompt, max_new_tokens: int, sampling: Sampling) -> list[int]:
        prompt = _token_ids(prompt)
        if not prompt:
            raise ShardError("the prompt is empty")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ShardError(f"prompt ({len(prompt)}) + new tokens ({max_new_tokens}) exceed {self.max_len}")
        if max(prompt) >= self.cfg.vocab_size or min(prompt) < 0:
            raise ShardError(f"prompt token ids must lie in 0..{self.cfg.vocab_size - 1}")
        sampling.validate()
        return prompt

    def group(self, prompt, n: int, max_new_tokens: int, sampling: Sampling, key) -> tuple[jax.Array, jax.Array]:
        """n completions of one prompt sampled side by side (GRPO's group): one prefill, its cache repeated
        n times, then n rows a decode step. (n, max_new_tokens) token ids and each one's log-probability
        under the temperature's softmax (`sample_with_logp`); all run to max_new_tokens (the caller cuts
        each at its end of text). `key`: a jax.random key; token i draws with fold_in(key, i)."""
        prompt = self._checked(prompt, max_new_tokens, sampling)
        cache = jax.device_put(init_cache(self.cfg, 1, self.max_len), self.cache_sharding)
        logits, cache = self._forward(self.params, jnp.asarray([prompt], jnp.int32), cache, 0, self.router_bias)
        logits, cache = jnp.repeat(logits, n, axis=0), self._repeat(cache, n)
        tokens, logps = [], []
        for i in range(max_new_tokens):
            token, logp = self._sample_logp(logits, jax.random.fold_in(key, i), sampling)
            tokens.append(token)
            logps.append(logp)
            if i + 1 < max_new_tokens:
                logits, cache = self._forward(self.params, token[:, None].astype(jnp.int32), cache,
                                              len(prompt) + i, self.router_bias)
        return jnp.stack(tokens, axis=1), jnp.stack(logps, axis=1)

    def stream(self, prompt, max_new_tokens: int, sampling: Sampling, seed: int = 0) -> Iterator[int]:
        """`prompt`: one sequence of token ids (a list, or a 1-D array such as ByteTokenizer.encode's)."""
        prompt = self._checked(prompt, max_new_tokens, sampling)
        cache = jax.device_put(init_cache(self.cfg, 1, self.max_len), self.cache_sharding)
        key = jax.random.key(seed)
        logits, cache = self._forward(self.params, jnp.asarray([prompt], jnp.int32), cache, 0, self.router_bias)
        pos = len(prompt)
        for i in range(max_new_tokens):
            token = self._sample(logits, jax.random.fold_in(key, i), sampling)
            yield int(token[0])
            if i + 1 < max_new_tokens:
                logits, cache = self._forward(self.params, token[:, None].astype(jnp.int32), cache, pos,
                                              self.router_bias)
                pos += 1

    def generate(self, prompt, max_new_tokens: int, sampling: Sampling, seed: int = 0,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        out = []
        for t in self.stream(prompt, max_new_tokens, sampling, seed):
            out.append(t)
            if on_token:
                on_token(t)
        return out
