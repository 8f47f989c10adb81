"""Fused layer pieces: around the token-mixer ops (short causal conv + SiLU + L2 norm, gate
activations, gated RMSNorm), and the layers' RMSNorm, softmax attention's RoPE and the loss's
cross-entropy; an fp32 reference (``reference.py``), Triton kernels (``triton.py``) and their
autograd entry points with the backend choice (``ops.py``), where also a fused projection's
output is split so that the kernels write their input gradients into one buffer
(``split_projection``)."""
from .ops import (ProjectionGradient, cross_entropy, first_use_check, gate, gated_rms_norm,
                  rms_norm, rope, rope_fits, short_conv, split_projection)
from .reference import sequence_positions

__all__ = ["ProjectionGradient", "cross_entropy", "first_use_check", "gate", "gated_rms_norm",
           "rms_norm", "rope", "rope_fits", "sequence_positions", "short_conv", "split_projection"]
