"""megatron_ext.multi_tensor: the foreach gradient norm and scale against plain torch, and their
installation in place of megatron-core's Python fallbacks (tests/ops/test_megatron_clipping.py runs
megatron-core's clipping with them on a GPU)."""
import pytest
import torch

from megatron_ext import multi_tensor

FLAG = torch.zeros(1, dtype=torch.int)


def _tensors(dtype):
    generator = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (64, 33), (1,), (2, 3, 4)]
    return [torch.randn(*s, generator=generator).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2_norm_is_the_norm_of_all_tensors_as_one_vector(dtype):
    tensors = _tensors(dtype)
    total, per = multi_tensor.l2_norm(2048, FLAG, [tensors], True)
    flat = torch.cat([t.float().flatten() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total[0], torch.linalg.vector_norm(flat), rtol=1e-6, atol=0)
    torch.testing.assert_close(per, torch.stack([torch.linalg.vector_norm(t.float())
                                                 for t in tensors]), rtol=1e-6, atol=0)
    assert multi_tensor.l2_norm(2048, FLAG, [tensors], False)[1] is None
    empty, _ = multi_tensor.l2_norm(2048, FLAG, [[]], False)
    assert empty.tolist() == [0.0]


def test_scale_in_place_across_dtypes_and_as_a_copy():
    grads = _tensors(torch.float32)
    expected = [g * 0.25 for g in grads]
    multi_tensor.scale(2048, FLAG, [grads, grads], 0.25)  # src is dst: clipping in place
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    main = _tensors(torch.float32)  # fp32 main parameters into bf16 model parameters
    model = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    multi_tensor.scale(2048, FLAG, [main, model], 1.0)
    for got, want in zip(model, main):
        assert torch.equal(got, want.to(torch.bfloat16))
    multi_tensor.scale(2048, FLAG, [main, model], 3.0)
    for got, want in zip(model, main):
        assert torch.equal(got, (want * 3.0).to(torch.bfloat16))
    with pytest.raises(ValueError, match="2 sources for 1 targets"):
        multi_tensor.scale(2048, FLAG, [main[:2], model[:1]], 1.0)


def test_only_megatrons_fallbacks_are_replaced(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.training.utils import common_utils  # megatron.training's --log-params-norm

    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (optimizer, "multi_tensor_scale_impl"),
                         (common_utils, "multi_tensor_l2norm")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    # This machine has neither apex nor Transformer Engine: megatron-core runs its fallbacks.
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert multi_tensor.use_foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    assert optimizer.multi_tensor_scale_impl is multi_tensor.scale
    assert common_utils.multi_tensor_l2norm is multi_tensor.l2_norm
    assert not multi_tensor.use_foreach_multi_tensor_ops()  # nothing left to replace

    # megatron-core's copy of the optimizer's fp32 parameters into the model's, through it
    main = _tensors(torch.float32)
    model = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    optimizer._multi_tensor_copy_this_to_that(main, model, torch.zeros(1, dtype=torch.int))
    for got, want in zip(model, main):
        assert torch.equal(got, want.to(torch.bfloat16))

    # a kernel of apex's or TE's (any other function) is left alone
    def apex_like(*args):
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_like)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", apex_like)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", apex_like)
    assert not multi_tensor.use_foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is apex_like
