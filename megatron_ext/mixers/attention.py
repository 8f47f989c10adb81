"""Softmax self-attention: Megatron's SelfAttention with a torch SDPA core.

Megatron's local core (``DotProductAttention``) materialises the ``[b, heads, s, s]`` score
matrix. :class:`SDPACoreAttention` hands the same query/key/value to
``torch.nn.functional.scaled_dot_product_attention`` instead, which runs flash / cuDNN /
memory-efficient kernels on CUDA and a fused math path on the CPU. It keeps the core-attention
contract of ``SelfAttention`` (``[s, b, heads, d]`` in, ``[s, b, heads * d]`` out; ``thd``
packed sequences as ``[t, heads, d]``), so it drops into Megatron's own attention layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Core attention on torch SDPA: causal or masked, grouped-query heads, packed sequences.

    Masks follow Megatron's convention: ``attention_mask`` is boolean with True where a query
    must NOT attend. With the causal mask type and no mask, SDPA's ``is_causal`` path is used,
    which is the one that reaches the flash kernels.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        unsupported = []
        if config.context_parallel_size > 1:
            unsupported.append(f"context_parallel_size={config.context_parallel_size}")
        if config.window_size is not None:
            unsupported.append(f"window_size={config.window_size}")
        if config.softmax_type != "vanilla":
            unsupported.append(f"softmax_type={config.softmax_type!r}")
        if unsupported:
            raise NotImplementedError(
                f"the SDPA core attention does not support {', '.join(unsupported)}; "
                "use attention_backend='te' (Transformer Engine) for these options"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # apply_query_key_layer_scaling only guards fp16 overflow in the unfused path; SDPA
        # accumulates in fp32, so the plain 1/sqrt(d) scale is the same function.
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None,
                attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """query ``[sq, b, hq, d]``, key/value ``[sk, b, hkv, d]`` -> ``[sq, b, hq * d]``.

        With ``thd`` packing the batch dimension is absent (``[t, h, d]``) and sequences are
        separated by ``packed_seq_params.cu_seqlens_q``.
        """
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by the SDPA core")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)

        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        allowed = self._allowed_mask(q, k, attention_mask, mask_type, packed_seq_params)
        is_causal = allowed is None and mask_type == AttnMaskType.causal and q.shape[2] > 1
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        out = out.permute(2, 0, 1, 3)  # [sq, b, hq, d]
        if packed:
            return out.reshape(out.shape[0], -1)
        return out.reshape(out.shape[0], out.shape[1], -1)

    @staticmethod
    def _allowed_mask(q, k, attention_mask, mask_type, packed_seq_params):
        """SDPA's boolean mask (True = may attend), or None for the plain causal fast path."""
        sq, sk = q.shape[2], k.shape[2]
        allowed = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # Block-diagonal: a token attends only within its own sequence of the pack.
            seq_q = _sequence_ids(packed_seq_params.cu_seqlens_q, sq)
            seq_k = _sequence_ids(packed_seq_params.cu_seqlens_kv, sk)
            allowed = seq_q[:, None] == seq_k[None, :]
        if attention_mask is not None:
            not_masked = ~attention_mask.bool()
            allowed = not_masked if allowed is None else allowed & not_masked
        if allowed is not None and mask_type == AttnMaskType.causal:
            allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        return allowed

    def _dropout_rng(self, dropout_p: float):
        """Dropout under TP must draw from the model-parallel RNG stream, as Megatron's core does."""
        import contextlib

        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def _sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[0, 3, 5]`` with total 5 -> ``[0, 0, 0, 1, 1]``."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)

