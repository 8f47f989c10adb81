"""Softmax attention with a sliding window and a learnable sink, and the sparse attentions MoBA,
NSA and DSA, behind one layout ``[B, T, H, D]`` (grouped heads: k and v may have fewer heads).

Backends, with one signature per op:
    reference   the dense fp32 definitions, explicit ``[B, H, T, S]`` masks (reference.py)
    gathered    the op as a block layout (layout.py) run in PyTorch: each query block gathers
                the key blocks it visits; any device, memory linear in T (gathered.py)
    flex        the same layout as a FlexAttention BlockMask; compiled on CUDA; on the CPU
                forward only (flex.py)
    flash       ``softmax_attention``, ``moba_attention`` (no window) and
                ``nsa_attention`` (its selected and window branches) only: torch's
                FlashAttention-2 kernels with the sink applied through their log-sum-exp (and
                cuDNN's fused attention for MoBA's and NSA's own blocks where every block is
                full, and for their earlier blocks from blocks of 128, once cuDNN passed its
                own first-use check); CUDA, fp16/bf16, no extra mask (flash.py);
                ``dsa_attention`` of a causal selection on cuDNN's fused attention, the
                selection an additive bias; and ``csa_attention`` given its entries'
                compression ``rate``: the window on FlashAttention-2, the selected entries on
                cuDNN with the selection as a bias
    triton      ``dsa_attention`` and ``csa_attention`` only, and the sparse stage of
                ``dsa_indexer_loss`` and ``csa_indexer_loss`` (its target and its KL): our
                Triton kernels of the per-token selected attention and of the indexer's loss,
                forward and backward; CUDA, fp32/bf16/fp16, head dims up to 256 (triton.py and
                triton_indexer.py; imported on first use, so that this package imports where
                Triton does not)
Each op declares its backends in the backend registry (``kernels.registry``; the rules of what
each takes, over the call's facts, and the first-use verifiers are routing.py's): a backend
named that cannot take the call raises ``registry.BackendUnavailable`` (a ValueError) with the
reason, an unknown name ValueError, and "auto"'s choice is logged once.
"auto" is flex on CUDA (head dims of 16 or more) and gathered elsewhere; for softmax_attention
and moba_attention it is flash where flash.py covers the call and has passed its first-use check
on the device, and so it is for nsa_attention's selected and window branches from
``nsa.NSA_FLASH_MIN_LEN`` tokens a sequence.
``layout_blocks=(q_block, kv_block)`` overrides the layout's block sizes (defaults: 128 x 128
for flex, 64 x 64 for gathered; 16 x 64 for NSA's selected branch in gathered, whose queries
pick their own blocks); the result does not depend on them.

DSA selects keys per token; its ops (``dsa_select``, ``dsa_attention``, ``dsa_indexer_loss``)
run the reference or, for every other backend, the per-token gathered form of selected.py (the
selection's scores in triton_indexer.py's kernel on CUDA); but ``dsa_attention`` (and CSA's
``csa_attention``), and the indexer losses' sparse stage, run triton.py's kernels with
"triton", and with "auto" on CUDA where they take the call and have passed their first-use
check on the device in the call's dtype. With "flex", and with "auto" on CUDA for up to
``dsa.SELECTED_FLEX_MAX_KEYS`` keys, ``dsa_attention`` and ``csa_attention`` run FlexAttention over
the selection written as a bitmap (``layout.key_selection_layout``): dense tiles on tensor
cores instead of a gather of each query's keys per key/value head (the indexer losses' sparse
stage runs as under "auto" then). A selection declared causal (``dsa_attention(...,
causal=True)``, as the DSA layer declares ``dsa_select``'s) runs, with "flash" and with "auto"
before those, on cuDNN's fused attention with the selection as an additive bias (flash.py).

DeepSeek-V4's compressed attentions (compressed.py): ``compress_kv`` makes one entry per block
of tokens; HCA's ``compressed_attention`` (all the entries a query sees, plus a sliding window)
is a block layout, run like ``softmax_attention``; CSA's ``csa_select``, ``csa_attention`` and
``csa_indexer_loss`` pick entries per token and run like DSA's ops, but ``csa_attention`` given
``rate=`` runs, with "flash" and with "auto" before those, on flash.py's window + entries split
(both kernels' first-use checks passed), and returns the entries' log-sum-exp for the loss.

``exclusive_self_attention`` (XSA) post-processes any attention output.

Modules: one per op family (softmax.py, moba.py, nsa.py, dsa.py with the per-token selected
attention CSA shares, csa_hca.py), the backends' rules they share (routing.py), the references
(reference.py), the layouts and their executors (layout.py, compressed.py, gathered.py,
flex.py), and the fast paths (flash.py, selected.py, the triton*.py kernels).
"""

from .compressed import compressed_entries
from .csa_hca import compress_kv, compressed_attention, csa_attention, csa_indexer_loss, csa_select
from .dsa import dsa_attention, dsa_indexer_loss, dsa_select
from .moba import moba_attention
from .nsa import nsa_attention
from .reference import exclusive_self_attention
from .selected import QueryShares
from .softmax import softmax_attention

__all__ = [
    "softmax_attention", "moba_attention", "nsa_attention", "dsa_select",
    "dsa_attention", "dsa_indexer_loss", "compressed_entries", "compress_kv",
    "compressed_attention", "csa_select", "csa_attention", "csa_indexer_loss", "QueryShares",
    "exclusive_self_attention",
]
