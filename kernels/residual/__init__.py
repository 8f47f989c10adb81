"""Residual-stream ops of mHC (Xie et al. 2025) and Attention Residuals (Kimi Team 2026).

    reference   plain autograd PyTorch, fp32: the definitions (reference.py)
    efficient   the same values through autograd Functions that keep little for backward and
                recompute the Sinkhorn iterations; optionally torch.compile'd (efficient.py)
    triton_sinkhorn  the Sinkhorn iterations in two Triton kernels, forward and backward
    triton_mhc  mHC's pre op and stream update fused in Triton kernels, forward and backward
    triton_depth  Attention Residuals' depth attention in one Triton kernel each way for all
                source groups of a call; ``efficient`` runs the three Triton modules on CUDA
                after a first-use check (imported there on first use), as its ops'
                declarations in the backend registry (kernels.registry) say
    triton_common  the helpers those three share (division, token blocks, launch device)

The model code (megatron_ext.residual) uses ``efficient``; tests compare it with ``reference``.
"""
from . import efficient, reference
from .reference import EPS

__all__ = ["EPS", "efficient", "reference"]
