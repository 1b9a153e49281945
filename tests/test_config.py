"""Config layering and validation."""

import pytest

from shard import config as c
from shard.errors import ShardError


def test_defaults_resolve():
    cfg = c.resolve({})
    assert cfg.model.name == "small" and cfg.mesh.spec == "dp"


def test_set_overrides_with_types():
    cfg = c.resolve(c.parse_sets(["optimizer.lr=3e-4", "model.name=tiny", "model.d_model=128",
                                  "rules.batch=data,fsdp", "rules.vocab=none", "model.tie_embeddings=false"]))
    assert cfg.optimizer.lr == 3e-4 and cfg.model.d_model == 128 and cfg.model.n_layers == 2
    assert cfg.rules == {"batch": ("data", "fsdp"), "vocab": ()}
    assert cfg.model.tie_embeddings is False


@pytest.mark.parametrize("item, message", [
    ("optimizer.lrr=1", "unknown config key 'optimizer.lrr'"),
    ("stepz=3", "unknown config key 'stepz'"),
    ("optimizer.lr=abc", "optimizer.lr expects float"),
    ("model.name=gpt9", "unknown model 'gpt9'"),
    ("rules.heads=tensor", "unknown mesh axis 'tensor'"),
    ("rules.experts=model", "unknown logical axis 'experts'"),
    ("model.n_kv_heads=3", "multiple of model.n_kv_heads"),
    ("data.microbatches=3", "multiple of data.microbatches"),
    ("noequals", "key=value"),
    ("optimizer.grad_clip=-1", r"optimizer.grad_clip must be positive \(inf: no clipping\), got -1.0"),
    ("optimizer.b2=2", r"optimizer.b2 must be in \[0, 1\)"),
    ("optimizer.b1=1", r"optimizer.b1 must be in \[0, 1\)"),  # Adam's bias correction divides by 1 - b1
    ("optimizer.lr=nan", "optimizer.lr expects a number, got nan"),
    ("optimizer.lr=inf", "optimizer.lr must be a finite positive number, got inf"),
    ("guard.max_grad_norm=0", r"guard.max_grad_norm must be positive \(inf: off\)"),
    ("checkpoint.keep_best=0", "checkpoint.keep_best must be positive, got 0"),
    ("checkpoint.local_every=-1", r"checkpoint.local_every must be 0 \(off\) or positive, got -1"),
    ('checkpoint.local_dir=""', 'checkpoint.local_dir must be "auto" or a folder, got ""'),
    ("model.rope_theta=0", "model.rope_theta must be a positive number"),
    ("model.norm_eps=-1", "model.norm_eps must be a positive number"),
    ('param_regex.(=["embed"]', "is not a regular expression"),
    ("param_regex.x=[1,2]", "param_regex.x expects tuple"),
    ('rules.batch=["data","data"]', "mesh axis named twice"),
    ("model.name.x=1", r"model.name expects str, got \{'x': 1\}"),
    # the step counter is int32: 2**31 steps overflowed building the schedule, with a traceback
    ("steps=2147483648", r"steps must be positive and below 2\*\*31, got 2147483648"),
    # past int64 it was a traceback from XLA, parsing an argument to a jitted computation
    ("model.n_experts=99999999999999999999", r"model.n_experts must be 0 \(dense\) or more and below 2\*\*31"),
    ("cluster.bind=0.0.0.0/0 ", r"cluster.bind must be auto, loopback, all or a network interface's name"),
])
def test_bad_sets(item, message):
    if item.startswith("optimizer.grad_clip"):
        assert c.resolve(c.parse_sets(["optimizer.grad_clip=inf"])).optimizer.grad_clip == float("inf")  # off
    with pytest.raises(ShardError, match=message):
        c.resolve(c.parse_sets([item]))


@pytest.mark.parametrize("items, message", [
    (["checkpoint.best_metric=eval_loss"], "needs evaluations: set eval.every"),
    (["checkpoint.best_metric=eval_loss", "eval.every=300"],
     r"checkpoint.every \(1000\) is not a multiple of eval.every \(300\); use a multiple of 300"),
])
def test_ranking_by_eval_loss_needs_an_evaluation_at_every_save(items, message):
    with pytest.raises(ShardError, match=message):
        c.resolve(c.parse_sets(items))
    assert c.resolve(c.parse_sets([*items, "eval.every=500"])).checkpoint.best_metric == "eval_loss"


def test_written_config_reads_back_the_same(tmp_path):
    cfg = c.resolve(c.parse_sets(["model.name=tiny", "rules.mlp=model", "param_regex.foo/.*=embed,mlp",
                                  "steps=7"]))
    p = tmp_path / "config.toml"
    p.write_text(c.to_toml(cfg))
    assert c.resolve(c.load_file(str(p))) == cfg


def test_file_then_set_precedence(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('steps = 5\n[optimizer]\nlr = 0.01\n[model]\nname = "tiny"\n')
    cfg = c.resolve(c.merge(c.load_file(str(p)), c.parse_sets(["optimizer.lr=0.02"])))
    assert (cfg.steps, cfg.optimizer.lr, cfg.model.name) == (5, 0.02, "tiny")


@pytest.mark.parametrize("text, message", [
    ('steps = "ten"\n', "steps expects int, got 'ten'"),
    ("[model]\nname = [1]\n", r"model.name expects str, got \[1\]"),
    ('[model]\nd_model = "wide"\n', "model.d_model expects int"),
    ("[optimizer]\nlrr = 1\n", "unknown config key 'optimizer.lrr'"),
])
def test_a_wrong_value_in_the_file_is_refused_even_where_a_flag_overrides_it(tmp_path, text, message):
    p = tmp_path / "run.toml"
    p.write_text(text)
    with pytest.raises(ShardError, match=f"config file {p}: config key {message}|config file {p}: {message}"):
        c.merge(c.load_file(str(p)), c.parse_sets(["steps=3", "model.name=tiny", "model.d_model=64"]))


def test_a_config_file_may_start_with_a_byte_order_mark(tmp_path):
    p = tmp_path / "run.toml"  # as Windows editors write it: it read as "Invalid statement (at line 1)"
    p.write_bytes(b"\xef\xbb\xbfsteps = 5\n")
    assert c.resolve(c.load_file(str(p))).steps == 5


def test_docs_config_md_lists_every_key_with_its_default():
    """docs/config.md is the reference for the keys: each one, with the default `config.toml` writes."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    documented = dict(re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", doc, re.M))
    written, section = {}, ""
    # a list tomli_w writes over several lines, as one: ["wq", "wv"]
    text = re.sub(r"\[\n((?:\s+.+,\n)+)\]", lambda m: "[" + ", ".join(
        v.strip().rstrip(",") for v in m.group(1).splitlines()) + "]", c.to_toml(c.resolve({})))
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]") + "."
        elif " = " in line:
            key, value = line.split(" = ", 1)
            written[section + key] = value
    assert documented == written


def test_a_text_key_takes_the_value_as_typed():
    """TOML read `2024-01-01` as a date and `0.10` as 0.1; a quoted rule-table key kept its quotes."""
    sets = c.parse_sets(["eval.path=2024-01-01", "data.path=0.10", 'param_regex."x.y"=embed', 'run_dir="a b"',
                         "optimizer.lr=1e-3"])
    assert sets == {"eval": {"path": "2024-01-01"}, "data": {"path": "0.10"}, "param_regex": {"x.y": "embed"},
                    "run_dir": "a b", "optimizer": {"lr": 1e-3}}
