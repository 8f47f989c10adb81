"""Fused layer pieces: around the token-mixer ops (short causal conv + SiLU + L2 norm, gated
RMSNorm), and the layers' RMSNorm and softmax attention's RoPE; an fp32 reference
(``reference.py``), Triton kernels (``triton.py``) and their autograd entry points with the
backend choice (``ops.py``)."""
from .ops import first_use_check, gated_rms_norm, rms_norm, rope, rope_fits, short_conv
from .reference import sequence_positions

__all__ = ["first_use_check", "gated_rms_norm", "rms_norm", "rope", "rope_fits",
           "sequence_positions", "short_conv"]
