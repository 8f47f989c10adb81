"""Token-mixer kernels for megatron-ext, installed as ``megatron_ext.kernels``: PyTorch and Triton
ops with a reference next to each fast path, their backends in one registry (registry.py);
nothing here imports Megatron."""
from . import registry
from .decay import decay_linear_attention
from .delta_rule import gated_delta_rule
from .dplr import dplr_delta_rule

__all__ = ["declared_ops", "decay_linear_attention", "dplr_delta_rule", "gated_delta_rule"]


def declared_ops() -> dict[str, registry.Op]:
    """Every op of the backend registry, by name: imports the packages that declare them (the
    fused layer ops, the sparse attentions and the residual-stream ops load on first use)."""
    from . import fused, residual, sparse  # noqa: F401 - importing them declares their ops

    return registry.ops()
