"""Token-mixer kernels for megatron-ext, installed as ``megatron_ext.kernels``: pure PyTorch
(and later Triton) ops with a reference next to each fast path; nothing here imports Megatron."""
from .delta_rule import gated_delta_rule

__all__ = ["gated_delta_rule"]
