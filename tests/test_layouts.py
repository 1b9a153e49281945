"""The same seed and data give the same losses and gradient norms at every step on every layout (fp32):
sharding changes where the math runs, never what it computes. Four steps without warm-up, so three updates
reach the losses; the gradient norm catches a gradient scaled by a constant, which the losses would not."""

import numpy as np
import pytest

from shard.testing import agreement_config, assert_same_curves, train_curves

RTOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return train_curves(agreement_config("1x1"))


@pytest.mark.parametrize("mesh", ["8x1", "1x8", "2x4", "fsdp", "fsdp_tp:4x2", "data=2,fsdp=2,model=2"])
def test_losses_match_single_device(mesh, reference):
    curves = train_curves(agreement_config(mesh))
    assert len(curves["loss"]) == 4
    assert_same_curves(curves, reference, RTOL)


def test_losses_change_between_steps(reference):
    # Distinct numbers for the comparison above to check (the steps read different batches; that a step
    # updates the parameters is test_step.py's), and every update with a learning rate above 0
    assert len(set(np.round(reference["loss"], 6))) == 4 and len(set(np.round(reference["grad_norm"], 6))) == 4


def test_gqa_with_tensor_parallel_matches_single_device():
    kw = dict(model__n_kv_heads=4, model__attention="reference")
    assert_same_curves(train_curves(agreement_config("2x4", **kw)), train_curves(agreement_config("1x1", **kw)), RTOL)


def test_gradient_accumulation_matches_one_big_batch(reference):
    assert_same_curves(train_curves(agreement_config("2x4", data__microbatches=2)), reference, RTOL)


def test_untied_embeddings_and_remat_match_single_device():
    kw = dict(model__tie_embeddings=False, model__remat="full")
    assert_same_curves(train_curves(agreement_config("fsdp", **kw)), train_curves(agreement_config("1x1", **kw)), RTOL)


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny", "mistral-tiny", "mixtral-tiny", "gemma2-tiny",
                                    "gemma3-tiny"])
def test_model_families_match_single_device(preset):
    """Each family's new weights (q/k/v biases, q/k norms, Mixtral's experts) name their logical axes, so
    every layout shards them by the same rules: FSDP with tensor parallel, and data x FSDP x tensor
    parallel; Mistral's window (8) is shorter than the sequence (32), as are Gemma's local layers'."""
    reference = train_curves(agreement_config("1x1", model__name=preset))
    for mesh in ("fsdp_tp:4x2", "data=2,fsdp=2,model=2"):
        assert_same_curves(train_curves(agreement_config(mesh, model__name=preset)), reference, RTOL, mesh)
