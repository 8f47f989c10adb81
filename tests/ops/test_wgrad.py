"""megatron_ext.wgrad on a GPU: the weight gradient accumulated by the GEMM into an fp32
main_grad equals the fp32 product, in the function and through Megatron's linear layer."""
import pytest
import torch

from megatron_ext import wgrad

pytestmark = pytest.mark.gpu


def test_accumulating_gemm_matches_fp32():
    assert wgrad.check_error("cuda") < 1e-6


@pytest.mark.usefixtures("megatron_on_cuda")
def test_megatron_column_linear_accumulates_into_main_grad():
    """After provide_gradient_accumulation_fusion, a ColumnParallelLinear built with the fusion
    on adds grad^T @ input of two micro-batches into its fp32 main_grad (bf16 operands) and
    leaves the fp32 reference's sum there."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    assert wgrad.provide_gradient_accumulation_fusion()
    config = ModelParallelConfig(params_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
    layer = ColumnParallelLinear(256, 384, config=config, init_method=torch.nn.init.normal_,
                                 bias=False).cuda()
    layer.weight.main_grad = torch.zeros(384, 256, device="cuda")
    gen = torch.Generator().manual_seed(0)
    expected = torch.zeros(384, 256, device="cuda")
    for _ in range(2):
        x = torch.randn(100, 3, 256, generator=gen).cuda().bfloat16().requires_grad_()
        probe = torch.randn(100, 3, 384, generator=gen).cuda().bfloat16()
        out, _ = layer(x)
        out.backward(probe)
        expected += probe.float().flatten(0, 1).t() @ x.detach().float().flatten(0, 1)
    error = (layer.weight.main_grad - expected).norm() / expected.norm()
    assert error < 1e-6, error
