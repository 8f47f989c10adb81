"""A torch LayerNorm/RMSNorm that works with sequence parallelism, for runs without TE or apex.

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``. Under SP each TP rank normalises
its own slice of the sequence with the same (replicated) weights, so the weight gradients must
be summed over TP; Megatron does that for parameters marked ``sequence_parallel=True``.
Like ``WrappedTorchNorm``, this returns the plain torch module, so checkpoint keys match.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported without Transformer "
                "Engine; use LayerNorm or RMSNorm"
            )
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
