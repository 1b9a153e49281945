"""Muon (Newton-Schulz orthogonalised momentum) on the layers' weight matrices, AdamW on the rest, from
optax.contrib's pieces; which axes of each stored weight form the matrix it orthogonalises.

optax.contrib.muon itself is not used whole: its AdamW half takes one weight decay for every leaf (no
mask: it would decay norms and biases, which shard's AdamW leaves alone) and shares Muon's eps. So the
two halves are optax.partition'ed here: optax.contrib.scale_by_muon (what muon() chains) on the
matrices, then the RMS scaling muon() applies (its scale_by_shape, private in optax 0.2.8, is
`_scale_by_shape` here), shard's masked AdamW on the rest. On sharded weights the Newton-Schulz
iterations run on whole matrices, spread over the devices by layer (`_whole`). MuonClip's QK-clip
(`qk_clip`), applied by the step after the update, is here too.
"""

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from shard.axes import EMBED
from shard.config.model import ModelConfig
from shard.config.params import MATRIX_BATCH_AXES, model_params, muon_matrix
from shard.config.train import OptimizerConfig
from shard.sharding.rules import active_layout


def matrix_axes(axes: tuple, init) -> MuonDimensionNumbers | None:
    """The (reduction, output) axes of a stored weight with these logical axes and initial values
    (shard.config.params.ParamSpec.init), or None where it is not a matrix Muon orthogonalises: the
    embedding and the head (a vocab axis), norms and biases (constant initial values) and vectors. A
    weight that writes the residual stream (embed its last axis: wo, w_down) reads all its other axes;
    the others read their first (embed, or a latent) and write the rest (wq: embed -> heads x head_dim)."""
    if not muon_matrix(axes, init):
        return None
    inner = [i for i, a in enumerate(axes) if a not in MATRIX_BATCH_AXES]
    if axes[inner[-1]] == EMBED:
        return MuonDimensionNumbers(reduction_axis=tuple(inner[:-1]), output_axis=(inner[-1],))
    return MuonDimensionNumbers(reduction_axis=(inner[0],), output_axis=tuple(inner[1:]))


def muon_dimension_numbers(model: ModelConfig) -> dict:
    """The params tree ({"embed", "layers": {...}, ...}) of each weight's MuonDimensionNumbers, None for
    those AdamW trains."""
    tree: dict = {}
    for path, spec in model_params(model).items():
        *outer, name = path.split("/")
        node = tree
        for key in outer:
            node = node.setdefault(key, {})
        node[name] = matrix_axes(spec.axes, spec.init)
    return tree


def muon(opt: OptimizerConfig, model: ModelConfig, schedule, adamw: optax.GradientTransformation):
    """Muon on the matrices of `model`, `adamw` on the rest, one `schedule` for both (muon_rms scales
    Muon's update to AdamW's RMS, so one lr and weight decay serve both, as Moonlight does)."""
    dims = muon_dimension_numbers(model)

    def labels(params):
        return jax.tree.map(lambda d, _: "adamw" if d is None else "muon", dims, params,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    def matrix_dims(updates):  # the Muon half's tree: optax.partition masks the others out of it
        return jax.tree.map(lambda d, u: d if d is not None else optax.MaskedNode(), dims, updates,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    matrices = optax.chain(
        _whole(scale_by_muon(ns_steps=opt.muon_ns_steps, beta=opt.muon_beta, eps=opt.eps,
                             weight_dimension_numbers=matrix_dims)),
        _scale_by_shape(matrix_dims, opt.muon_rms),
        optax.add_decayed_weights(opt.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": matrices, "adamw": adamw}, labels)


def _whole(muon_tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """scale_by_muon on whole matrices, each layer's on some devices only (as torchtitan's DistMuon
    spreads them): under the layout the step is traced in (shard.sharding.rules.active_layout; none: as
    it is), a shard_map splits the stacked matrices' layer axis over the mesh axes whose sizes divide it
    (`_layer_axes`) and gives every device its layers' gradients and momenta whole (an all-to-all from
    the parameters' shards, an all-gather over the other axes), the Newton-Schulz iterations run locally,
    and the results go back to the parameters' shards. Left to the partitioner, the iterate stays split
    like its parameter (FSDP: by rows) and each of the three matmuls of each iteration all-gathers it
    again: 15 all-gathers of every matrix per step (small on fsdp: 105 MiB for 10.5 MiB of matrices), which
    is what runs where the layers do not spread over at least a quarter of the devices."""
    def update(updates, state, params=None):
        layout = active_layout()
        mesh = layout.mesh if layout is not None else None
        if mesh is None or mesh.size == 1:
            return muon_tx.update(updates, state, params)
        # per stack (the layers, DeepSeek's dense first layers, the MTP modules): its layer count's axes
        axes_of = {n: _layer_axes(mesh, n) for n in {u.shape[0] for u in jax.tree.leaves(updates)}}
        # each device holds 1 / ways of a stack's matrices whole: at most 4 / devices of them, the memory
        # of four fully sharded copies; fewer ways (61 layers on 256 devices) are left to the partitioner
        if any(not a or math.prod(mesh.shape[x] for x in a) * _MAX_COPIES < mesh.size for a in axes_of.values()):
            return muon_tx.update(updates, state, params)
        split = jax.tree.map(lambda u: PartitionSpec(axes_of[u.shape[0]]), updates)
        specs = (split, state._replace(count=PartitionSpec(), mu=split, ns_coeffs=PartitionSpec()))
        local = jax.shard_map(lambda u, s: muon_tx.update(u, s), mesh=layout.mesh, in_specs=specs,
                              out_specs=specs, check_vma=False)
        return local(updates, state)

    return optax.GradientTransformation(muon_tx.init, update)


_MAX_COPIES = 4


def _layer_axes(mesh, n_layers: int) -> tuple[str, ...]:
    """The mesh axes, in order, whose sizes multiply to a divisor of the layer count: the devices the
    layers' matrices are spread over (the rest repeat the same work)."""
    axes, ways = [], 1
    for name, size in mesh.shape.items():
        if size > 1 and n_layers % (ways * size) == 0:
            axes.append(name)
            ways *= size
    return tuple(axes)


def _axes(d: MuonDimensionNumbers, names: str) -> tuple[int, ...]:
    axes = getattr(d, names)
    return (axes,) if isinstance(axes, int) else tuple(axes)


def update_scale(shape: tuple[int, ...], d: MuonDimensionNumbers, rms: float) -> float:
    """The factor on an orthogonalised update of a weight of `shape`: sqrt(max(fan_in, fan_out)) * rms,
    an update of RMS `rms` (Moonlight), or for rms 0 sqrt(max(1, fan_out / fan_in)) (Keller Jordan's)."""
    fan_in = math.prod(shape[a] for a in _axes(d, "reduction_axis"))
    fan_out = math.prod(shape[a] for a in _axes(d, "output_axis"))
    return math.sqrt(max(fan_in, fan_out)) * rms if rms else math.sqrt(max(1.0, fan_out / fan_in))


def _scale_by_shape(dims_of, rms: float) -> optax.GradientTransformation:
    """Each orthogonalised update times update_scale (optax.contrib.muon's scaling, private in optax)."""
    def update(updates, state, params=None):
        del params
        scaled = jax.tree.map(lambda u, d: u * jnp.asarray(update_scale(u.shape, d, rms), u.dtype),
                              updates, dims_of(updates), is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return scaled, state

    return optax.GradientTransformation(optax.init_empty_state, update)


def qk_clip(params: dict, max_logit_ln: jax.Array, tau: float, model: ModelConfig) -> dict:
    """MuonClip's QK-clip (Kimi K2): each head h of layer l whose largest attention logit S passed `tau`
    has its logits scaled by gamma = tau / S, so they peak at tau; others are left alone. With one key
    head per query head both sides take sqrt(gamma) (q and k weights and biases); with grouped-query
    attention a key head serves several query heads, so the query side takes all of gamma."""
    over_ln = max_logit_ln > tau
    gamma_ln = jnp.where(over_ln, tau / jnp.where(over_ln, max_logit_ln, 1.0), 1.0)
    shared = model.n_kv_heads != model.n_heads
    q_ln, k_ln = (gamma_ln, None) if shared else (jnp.sqrt(gamma_ln), jnp.sqrt(gamma_ln))
    layers = dict(params["layers"])

    def scale(name: str, f_ln, head_axis: int):  # the weight times f, by layer and head
        w = layers[name]
        shape = [1] * w.ndim
        shape[0], shape[head_axis] = f_ln.shape
        layers[name] = (w * f_ln.reshape(shape)).astype(w.dtype)

    for side, f_ln in (("q", q_ln), ("k", k_ln)):
        if f_ln is not None:
            scale(f"w{side}", f_ln, 2)  # (L, D, heads, H)
            if f"b{side}" in layers:
                scale(f"b{side}", f_ln, 1)  # (L, heads, H)
    return params | {"layers": layers}
