"""megatron-core's gradient norm and clipping with megatron_ext.multi_tensor's foreach ops in
place of its Python fallbacks, on the GPU (skipped without CUDA): the same norm, the same
clipped gradients and the same copy of fp32 parameters into bf16 ones, without the per-tensor
synchronisations (counted with torch's sync debug mode)."""
import warnings

import pytest
import torch

from megatron_ext import multi_tensor

pytestmark = pytest.mark.gpu


def _grads():
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1024, 1024), (24, 4096), (24,), (3,), (1024,), (2816, 1024), (37, 5)]
    return [torch.randn(*s, device="cuda", generator=generator) for s in shapes]


def _syncs(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_clipping_equals_megatrons_fallbacks(megatron_on_cuda, monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.training.utils import common_utils

    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (optimizer, "multi_tensor_scale_impl"),
                         (common_utils, "multi_tensor_l2norm")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        pytest.skip("apex or Transformer Engine is installed: megatron-core runs their kernels")

    results = {}
    for label in ("fallback", "foreach"):
        if label == "foreach":
            assert multi_tensor.use_foreach_multi_tensor_ops()
        grads = _grads()
        norm = {}
        syncs = _syncs(lambda: norm.setdefault("value", clip_grads.get_grad_norm_fp32(grads)))
        params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm["value"])
        model = [torch.zeros_like(g, dtype=torch.bfloat16) for g in grads]
        optimizer._multi_tensor_copy_this_to_that(grads, model,
                                                  torch.zeros(1, dtype=torch.int, device="cuda"))
        results[label] = (norm["value"], [p.grad for p in params], model, syncs)

    (norm_a, clipped_a, model_a, syncs_a), (norm_b, clipped_b, model_b, syncs_b) = (
        results["fallback"], results["foreach"])
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads()])).item()
    assert norm_a == pytest.approx(expected, rel=1e-6)
    assert norm_b == pytest.approx(expected, rel=1e-6)
    assert norm_b > 1.0  # so the gradients were clipped
    for a, b in zip(clipped_a, clipped_b):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    for a, b in zip(model_a, model_b):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # The fallback reads every tensor's norm back to the host; ours only the total, once.
    assert syncs_a >= len(_grads())
    assert syncs_b <= 2
