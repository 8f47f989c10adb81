"""Token-mixer kernels for megatron-ext, installed as ``megatron_ext.kernels``: pure PyTorch
(and later Triton) ops with a reference next to each fast path; nothing here imports Megatron."""
from .decay import decay_linear_attention
from .delta_rule import gated_delta_rule
from .dplr import dplr_delta_rule

__all__ = ["decay_linear_attention", "dplr_delta_rule", "gated_delta_rule"]
