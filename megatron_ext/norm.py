"""A torch LayerNorm/RMSNorm that works with sequence parallelism, for runs without TE or apex.

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``. Under SP each TP rank normalises
its own slice of the sequence with the same (replicated) weights, so the weight gradients must
be summed over TP; Megatron does that for parameters marked ``sequence_parallel=True``.
Like ``WrappedTorchNorm``, this returns a torch module (RMSNorm: :class:`FusedRMSNorm`, a
``torch.nn.RMSNorm``), so checkpoint keys match.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = FusedRMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported without Transformer "
                "Engine; use LayerNorm or RMSNorm"
            )
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward and backward run in one Triton kernel each on CUDA
    (``megatron_ext.kernels.fused.rms_norm``, once the fused kernels have passed their
    first-use check on the GPU; torch's own otherwise, and on CPUs). In an H200 trace of
    hybrid-350m (benchmarks/results/throughput_h200.json) torch's backward spends twice as long
    summing the weight gradient as computing the input gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_ext.kernels import fused, registry

        if (self.weight is not None
                and registry.choose("rms_norm", "auto", device=x.device, dtype=x.dtype) == "triton"):
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            return fused.rms_norm(x, self.weight, eps, backend="triton")
        return super().forward(x)
