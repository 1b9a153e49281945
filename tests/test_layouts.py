"""The same seed and data give the same losses on every layout (fp32): sharding changes where the
math runs, never what it computes."""

import numpy as np
import pytest

from shard.testing import tiny_config, train_losses

RTOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return train_losses(tiny_config("1x1"))


@pytest.mark.parametrize("mesh", ["8x1", "1x8", "2x4", "fsdp", "fsdp_tp:4x2", "data=2,fsdp=2,model=2"])
def test_losses_match_single_device(mesh, reference):
    losses = train_losses(tiny_config(mesh))
    assert len(losses) == 3
    np.testing.assert_allclose(losses, reference, rtol=RTOL)


def test_losses_change_between_steps(reference):
    # Three distinct numbers for the comparison above to check (the steps read different batches; that
    # a step updates the parameters is test_step.py's)
    assert len(set(np.round(reference, 6))) == 3


def test_gqa_with_tensor_parallel_matches_single_device():
    kw = dict(model__n_kv_heads=4, model__attention="reference")
    np.testing.assert_allclose(train_losses(tiny_config("2x4", **kw)), train_losses(tiny_config("1x1", **kw)),
                               rtol=RTOL)


def test_gradient_accumulation_matches_one_big_batch(reference):
    np.testing.assert_allclose(train_losses(tiny_config("2x4", data__microbatches=2)), reference, rtol=RTOL)


def test_untied_embeddings_and_remat_match_single_device():
    kw = dict(model__tie_embeddings=False, model__remat="full")
    np.testing.assert_allclose(train_losses(tiny_config("fsdp", **kw)), train_losses(tiny_config("1x1", **kw)),
                               rtol=RTOL)


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny", "mistral-tiny", "mixtral-tiny", "gemma2-tiny",
                                    "gemma3-tiny"])
def test_model_families_match_single_device(preset):
    """Each family's new weights (q/k/v biases, q/k norms, Mixtral's experts) name their logical axes, so
    every layout shards them by the same rules: FSDP with tensor parallel, and data x FSDP x tensor
    parallel; Mistral's window (8) is shorter than the sequence (32), as are Gemma's local layers'."""
    reference = train_losses(tiny_config("1x1", model__name=preset))
    for mesh in ("fsdp_tp:4x2", "data=2,fsdp=2,model=2"):
        np.testing.assert_allclose(train_losses(tiny_config(mesh, model__name=preset)), reference, rtol=RTOL,
                                   err_msg=mesh)
