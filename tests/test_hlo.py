"""Collective parsing on known programs: hand-written HLO in every replica-group form, and real
programs compiled on the simulated devices."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shard.measure import hlo
from shard.testing import fake_mesh

AXES, SIZES = ("data", "model"), (2, 4)  # device id = 4 * data + model

HAND_WRITTEN = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%body (p.1: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p.1 = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p.1), index=0
  %v = f32[256]{0} get-tuple-element(%p.1), index=1
  %ar = f32[256]{0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %ar)
}

%slice_it (param_0: f32[64], param_1: s32[]) -> f32[8] {
  %param_0 = f32[64]{0} parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %ds = f32[8]{0} dynamic-slice(%param_0, %param_1), dynamic_slice_sizes={8}
}

ENTRY %main (a: f32[256], b: bf16[16], c: f32[64], d: f32[32]) -> f32[8] {
  %a = f32[256]{0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %c = f32[64]{0} parameter(2)
  %d = f32[32]{0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %a)
  %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ag = bf16[32]{0} all-gather(%b), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %ags = (f32[32]{0}, f32[128]{0}) all-gather-start(%d), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[128]{0} all-gather-done(%ags)
  %agc = ((f32[64]{0}, f32[32]{0}), (f32[256]{0}, f32[128]{0})) all-gather-start(%c, %d), channel_id=7, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agcd = (f32[256]{0}, f32[128]{0}) all-gather-done(%agc)
  %rs = f32[8]{0} reduce-scatter(%c), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, to_apply=%add
  %cp = f32[64]{0} collective-permute(%c), channel_id=5, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %chain = f32[64]{0} collective-permute(%c), channel_id=10, source_target_pairs={{0,4},{1,5},{2,6},{3,7}}
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%c), channel_id=8, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpsd = f32[64]{0} collective-permute-done(%cps)
  %cpc = ((f32[64]{0}, f32[32]{0}), (f32[64]{0}, f32[32]{0}), u32[], u32[]) collective-permute-start(%c, %d), channel_id=9, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpcd = (f32[64]{0}, f32[32]{0}) collective-permute-done(%cpc)
  %cpu_rs = f32[64]{0} all-reduce(%c), channel_id=6, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %pid = s32[] partition-id()
  ROOT %mine = f32[8]{0} fusion(%cpu_rs, %pid), kind=kLoop, calls=%slice_it
}
"""


@pytest.fixture(scope="module")
def parsed():
    return {c.name: c for c in hlo.collectives(HAND_WRITTEN, AXES, SIZES)}


def test_loop_body_counts_its_trip_count_and_iota_groups_name_the_axis(parsed):
    ar = parsed["ar"]
    assert (ar.kind, ar.axes, ar.group_size, ar.count) == ("all-reduce", ("model",), 4, 3)
    assert ar.result_bytes == 1024 and ar.wire_bytes == pytest.approx(2 * 3 / 4 * 1024)


def test_mesh_form_groups(parsed):
    ag = parsed["ag"]
    assert (ag.kind, ag.axes, ag.group_size, ag.result_bytes) == ("all-gather", ("data",), 2, 64)
    assert ag.wire_bytes == pytest.approx(32)


def test_async_pair_counts_once_with_its_output(parsed):
    ags = parsed["ags"]
    assert (ags.kind, ags.axes, ags.count, ags.result_bytes) == ("all-gather", ("model",), 1, 512)
    assert "agd" not in parsed


def test_combined_async_all_gather_counts_every_output(parsed):
    """XLA:GPU combines FSDP's all-gathers into one ((inputs), (outputs)) start: only the first output
    was counted."""
    agc = parsed["agc"]
    assert (agc.kind, agc.axes, agc.result_bytes) == ("all-gather", ("model",), (256 + 128) * 4)
    assert agc.wire_bytes == pytest.approx(3 / 4 * 1536)


def test_mesh_form_with_transposed_device_ids(parsed):
    # ids [[0,4],[1,5],[2,6],[3,7]] reshaped to (4, 2): the groups along axis_0 are {0,1,2,3}, {4,5,6,7}.
    rs = parsed["rs"]
    assert (rs.kind, rs.axes, rs.group_size) == ("reduce-scatter", ("model",), 4)
    assert rs.wire_bytes == pytest.approx(3 / 4 * 32 * 4)  # (n-1)/n of the input, 4x the output


def test_permute_pairs(parsed):
    assert parsed["cp"].axes == ("data",) and parsed["cp"].wire_bytes == 256
    # half the devices send (a pipeline's chain of 2 stages, not a ring): a device's average is half
    assert parsed["chain"].axes == ("data",) and parsed["chain"].wire_bytes == 128


def test_async_permute_counts_its_outputs_combined_or_not(parsed):
    """A combined start is ((in1, in2), (out1, out2), context): only one array of it was counted."""
    assert parsed["cps"].wire_bytes == 256 and "cpsd" not in parsed
    assert (parsed["cpc"].kind, parsed["cpc"].axes, parsed["cpc"].wire_bytes) == ("collective-permute", ("data",), 384)


def test_cpu_reduce_scatter_is_an_all_reduce_read_through_a_slice(parsed):
    rs = parsed["cpu_rs"]
    assert (rs.kind, rs.compiled_as, rs.axes) == ("reduce-scatter", "all-reduce+dynamic-slice", ("data", "model"))
    assert rs.wire_bytes == pytest.approx(2 * 7 / 8 * 256) and rs.logical_wire_bytes == pytest.approx(7 / 8 * 256)


SLICED = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%layer0 (param_0: f32[2,64], param_1: s32[]) -> f32[1,16] {
  %param_0 = f32[2,64]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %l0 = f32[1,64]{1,0} slice(%param_0), slice={[0:1], [0:64]}
  ROOT %ds = f32[1,16]{1,0} dynamic-slice(%l0, %zero, %param_1), dynamic_slice_sizes={1,16}
}

%layer1 (param_0: f32[2,64], param_1: s32[]) -> f32[1,16] {
  %param_0 = f32[2,64]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %l1 = f32[1,64]{1,0} slice(%param_0), slice={[1:2], [0:64]}
  ROOT %ds = f32[1,16]{1,0} dynamic-slice(%l1, %zero, %param_1), dynamic_slice_sizes={1,16}
}

%mine (param_0: f32[128], param_1: s32[]) -> f32[16] {
  %param_0 = f32[128]{0} parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %ds = f32[16]{0} dynamic-slice(%param_0, %param_1), dynamic_slice_sizes={16}
}

%mine_reshaped (param_0: f32[128], param_1: s32[]) -> f32[2,8] {
  %param_0 = f32[128]{0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %r = f32[16,8]{1,0} bitcast(%param_0)
  ROOT %ds = f32[2,8]{1,0} dynamic-slice(%r, %param_1, %zero), dynamic_slice_sizes={2,8}
}

ENTRY %main (g: f32[2,64], h: f32[128]) -> (f32[1,16], f32[1,16], f32[16], f32[2,8]) {
  %g = f32[2,64]{1,0} parameter(0)
  %h = f32[128]{0} parameter(1)
  %pid = s32[] partition-id()
  %stacked = f32[2,64]{1,0} all-reduce(%g), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %a = f32[1,16]{1,0} fusion(%stacked, %pid), kind=kLoop, calls=%layer0
  %b = f32[1,16]{1,0} fusion(%stacked, %pid), kind=kLoop, calls=%layer1
  %flat = f32[128]{0} all-reduce(%h), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %c = f32[16]{0} fusion(%flat, %pid), kind=kLoop, calls=%mine
  %d = f32[2,8]{1,0} fusion(%flat, %pid), kind=kLoop, calls=%mine_reshaped
  ROOT %t = (f32[1,16]{1,0}, f32[1,16]{1,0}, f32[16]{0}, f32[2,8]{1,0}) tuple(%a, %b, %c, %d)
}
"""


def test_slices_that_keep_a_share_of_an_all_reduce():
    """Over data x model (8), each device keeps 1/4 of a stacked gradient, read as two layers' slices
    (static slices tell them apart: 1/8 + 1/8): a reduce-scatter over 4 and an all-reduce over 2, not
    an 8-way reduce-scatter (below the minimum). Another gradient's one 1/8 part, read twice, once
    through a reshape, is kept once: an 8-way reduce-scatter (summed, it read as 1/4)."""
    by_name = {c.name: c for c in hlo.collectives(SLICED, AXES, SIZES)}
    stacked, flat = by_name["stacked"], by_name["flat"]
    assert (stacked.kind, stacked.compiled_as) == ("reduce-scatter", "all-reduce+dynamic-slice 1/4")
    assert stacked.logical_wire_bytes == pytest.approx(3 / 4 * 512 + 2 * 1 / 2 * 128)
    assert (flat.kind, flat.compiled_as) == ("reduce-scatter", "all-reduce+dynamic-slice")
    assert flat.logical_wire_bytes == pytest.approx(7 / 8 * 512)


def test_summary_and_bytes_by_axes(parsed):
    items = list(parsed.values())
    per_axis = hlo.bytes_by_axes(items)
    assert per_axis["model"] == pytest.approx(3 * 1536 + 384 + 96 + 1152)
    rows = hlo.summarize(items)
    assert {"kind", "axes", "count", "bytes_per_device"} <= set(rows[0])


@pytest.mark.parametrize("kind, fn, axis", [
    ("all-reduce", lambda x: lax.psum(x, "model"), "model"),
    ("all-gather", lambda x: lax.all_gather(x, "data", tiled=True), "data"),
    ("all-to-all", lambda x: lax.all_to_all(x, "model", 0, 0, tiled=True), "model"),
    ("collective-permute", lambda x: lax.ppermute(x, "data", [(0, 1), (1, 0)]), "data"),
])
def test_real_programs(kind, fn, axis):
    mesh = fake_mesh("2x4")
    spec = P(("data", "model"))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.ShapeDtypeStruct((8 * 64,), jnp.float32, sharding=NamedSharding(mesh, spec))
    items = [c for c in hlo.collectives(f.lower(x).compile().as_text(), AXES, SIZES) if c.axes]
    assert [(c.kind, c.axes) for c in items] == [(kind, (axis,))]
    n = SIZES[AXES.index(axis)]
    expected = {"all-reduce": 2 * (n - 1) / n * 256, "all-gather": (n - 1) / n * 256 * n,
                "all-to-all": (n - 1) / n * 256, "collective-permute": 256}[kind]
    assert items[0].wire_bytes == pytest.approx(expected)


def test_collectives_in_a_conditionals_branches_are_marked_as_an_upper_bound():
    """The HLO does not say which branch of a `lax.switch` runs: each counts as running on every call, so
    9 iterations over (identity, psum, psum of 2x) read 18 all-reduces where 6 run, and they were shown
    as exact. They are marked, and `inspect` prints them as an upper bound."""
    mesh = fake_mesh("2x4")

    def body(i, x):
        return lax.switch(i % 3, [lambda x: x, lambda x: lax.psum(x, "model"), lambda x: lax.psum(x * 2, "model")], x)

    f = jax.jit(jax.shard_map(lambda x: lax.fori_loop(0, 9, body, x), mesh=mesh, in_specs=P(), out_specs=P(),
                              check_vma=False))
    text = f.lower(jax.ShapeDtypeStruct((256,), jnp.float32)).compile().as_text()
    items = [c for c in hlo.collectives(text, AXES, SIZES) if c.axes]
    assert sum(c.count for c in items) == 18 and all(c.axes == ("model",) and c.in_branch for c in items), items
    assert all(r["upper_bound"] for r in hlo.summarize(items))
    assert not any(c.in_branch for c in hlo.collectives(HAND_WRITTEN, AXES, SIZES))  # a while body is exact


RAGGED = """HloModule r, is_scheduled=true

ENTRY %main (rows: f32[24,10], out: f32[24,10], offsets: s32[4], sizes: s32[4]) -> f32[24,10] {
  %rows = f32[24,10]{1,0} parameter(0)
  %out = f32[24,10]{1,0} parameter(1)
  %offsets = s32[4]{0} parameter(2)
  %sizes = s32[4]{0} parameter(3)
  ROOT %ra2a = f32[24,10]{1,0} ragged-all-to-all(%rows, %out, %offsets, %sizes, %offsets, %sizes), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}
}
"""


def test_a_ragged_all_to_all_counts_as_an_all_to_all_of_its_receive_buffer_and_a_bound():
    """GPUs and TPUs exchange dropless routing's tokens by ragged all-to-all (shard.parallel.ragged): it
    was not counted at all. Its receive buffer holds the worst case, so it is an upper bound."""
    (c,) = hlo.collectives(RAGGED, AXES, SIZES)
    assert (c.kind, c.compiled_as, c.axes, c.count) == ("all-to-all", "ragged-all-to-all", ("model",), 1)
    assert c.wire_bytes == pytest.approx(3 / 4 * 24 * 10 * 4) and c.upper_bound
    assert [r["upper_bound"] for r in hlo.summarize([c])] == [True]
    assert not any(c.upper_bound for c in hlo.collectives(HAND_WRITTEN, AXES, SIZES))
