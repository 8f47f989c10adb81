"""What the sparse ops share: what each of their backends takes, as rules over the call's facts
(``registry.Facts``) that their declarations in the backend registry (``kernels.registry``) read,
the facts of a call, the first-use verifiers, the block layouts' executors and block sizes, and
the checks of the sink and of top-k.

Each op module declares its op next to its functions (softmax.py, moba.py, nsa.py, dsa.py,
csa_hca.py), and the kernels inside the ops declare their Triton and PyTorch forms as ops of
their own, which run under "auto" only (layout.py: ``block_choice``, ``selection_words``,
``moba_selection``, ``nsa_selection``; selected.py: ``index_scores``; here: ``block_layout``, the
executor of NSA's compressed branch beside its flash branches). The facts of an attention call
(:func:`attention_facts`) carry q's device, dtype and head dim, and in ``extra`` the dtypes of
q, k and v, the query and key lengths, the elements of a batch row of k, and the op's own
options (``allowed``, ``log_forget``, ``window``, ``causal``, ``rate``, the selected keys); a
fact not given (the self-check asks with a device and dtype only) objects to nothing.
"""
import functools
import importlib
import math

import torch

from .. import backends, registry
from . import flash
from .flex import flex_attention_layout
from .gathered import gathered_attention
from .reference import OP

__all__ = ["attention_facts", "indexer_facts", "flash_refusal", "cudnn_refusal", "flex_refusal",
           "selected_kernels_refusal", "indexer_kernels_refusal", "flash_verified", "cudnn_verified",
           "flash_and_cudnn_verified", "selected_kernels_verified", "flash_backend",
           "layout_backends", "either", "unless", "FLEX_MIN_HEAD_DIM"]

_EXECUTORS = {"gathered": gathered_attention, "flex": flex_attention_layout}

# FlexAttention's compiled CUDA kernels take head dims of 16 and more (torch 2.11).
FLEX_MIN_HEAD_DIM = 16
_HALF = (torch.float16, torch.bfloat16)


def attention_facts(q, k, v, **extra) -> registry.Facts:
    """The facts of an attention call on q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]``, with the
    op's own in ``extra``."""
    return registry.Facts(device=q.device, dtype=q.dtype, key_dim=q.shape[-1], extra={
        "dtypes": (q.dtype, k.dtype, v.dtype), "seq_len": q.shape[1], "key_len": k.shape[1],
        "key_elements": math.prod(k.shape[1:]), **extra})


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _cudnn_enabled() -> bool:
    return torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()


def _dtypes(facts: registry.Facts):
    return facts.extra.get("dtypes", (facts.dtype,) * 3)


def flash_refusal(facts: registry.Facts) -> str | None:
    """Why torch's FlashAttention-2 kernels (flash.py) cannot run the call, or None: they take
    fp16 or bf16 q, k and v of one dtype, head dims that are multiples of 8 up to
    ``flash.MAX_HEAD_DIM``, keys as long as the queries and no extra mask, on CUDA GPUs of
    compute capability 8.0 or more."""
    extra, dtypes = facts.extra, _dtypes(facts)
    if facts.dtype is not None and (dtypes[0] not in _HALF or not dtypes[0] == dtypes[1] == dtypes[2]):
        return "FlashAttention takes fp16 or bf16 q, k and v of one dtype; got {}, {}, {}".format(*dtypes)
    if facts.key_dim is not None and (facts.key_dim % 8 or facts.key_dim > flash.MAX_HEAD_DIM):
        return (f"FlashAttention takes head dims that are multiples of 8 up to "
                f"{flash.MAX_HEAD_DIM}; got {facts.key_dim}")
    if extra.get("key_len", extra.get("seq_len")) != extra.get("seq_len"):
        return f"the keys ({extra['key_len']}) are not as long as the queries ({extra['seq_len']})"
    if extra.get("allowed"):
        return "FlashAttention takes no extra mask ('allowed')"
    if facts.device.type != "cuda":
        return "FlashAttention runs on CUDA only"
    if _capability(facts.device) < (8, 0):
        return "FlashAttention needs a GPU of compute capability 8.0 or more"
    return None


def cudnn_refusal(facts: registry.Facts) -> str | None:
    """Why cuDNN's fused attention (torch's SDPA backend) cannot take the call's blocks here, or
    None: CUDA, head dims up to ``flash.CUDNN_MAX_HEAD_DIM``, cuDNN's SDPA backend enabled."""
    if facts.device.type != "cuda":
        return "cuDNN's fused attention runs on CUDA only"
    if facts.key_dim is not None and facts.key_dim > flash.CUDNN_MAX_HEAD_DIM:
        return f"cuDNN's fused attention takes head dims up to {flash.CUDNN_MAX_HEAD_DIM} here"
    if not _cudnn_enabled():
        return "cuDNN (or torch's cuDNN SDPA backend) is not available or not enabled"
    return None


def flex_refusal(facts: registry.Facts) -> str | None:
    """Why FlexAttention's kernels cannot take the call: head dims under ``FLEX_MIN_HEAD_DIM``
    on CUDA."""
    if facts.device.type == "cuda" and facts.key_dim is not None and facts.key_dim < FLEX_MIN_HEAD_DIM:
        return (f"a head dim of {facts.key_dim} on CUDA (FlexAttention's kernels take "
                f"{FLEX_MIN_HEAD_DIM} or more): use 'gathered' or 'auto'")
    return None


@functools.cache
def _triton_module(name: str):
    """The sparse package's Triton module ``name``, or the reason it does not import."""
    try:
        return importlib.import_module(f".{name}", __package__), None
    except ImportError as error:
        return None, f"Triton does not import here ({error})"


def selected_kernels_refusal(facts: registry.Facts) -> str | None:
    """Why triton.py's selected-attention kernels cannot run the call, or None: they take q, k,
    v of one dtype (fp32, bf16 or fp16) with head dims up to ``triton.MAX_HEAD_DIM`` and fewer
    than 2^31 elements in a batch row of the keys (``selected_key_elements``, else
    ``key_elements``), on a CUDA device (or CPU tensors under Triton's interpreter,
    TRITON_INTERPRET=1)."""
    kernels, reason = _triton_module("triton")
    if kernels is None:
        return reason
    dtypes = _dtypes(facts)
    if facts.dtype is not None and (dtypes[0] not in kernels._DTYPES or not dtypes[0] == dtypes[1] == dtypes[2]):
        return ("the selected-attention kernels take q, k and v of one dtype among fp32, bf16 "
                "and fp16; got {}, {}, {}".format(*dtypes))
    if facts.key_dim is not None and facts.key_dim > kernels.MAX_HEAD_DIM:
        return (f"the selected-attention kernels take head dims up to {kernels.MAX_HEAD_DIM}; got "
                f"{facts.key_dim}")
    elements = facts.extra.get("selected_key_elements", facts.extra.get("key_elements", 0))
    if elements >= 2**31:
        return (f"the selected-attention kernels address a batch row's keys with 32-bit offsets; "
                f"S Hkv D = {elements} is too many")
    if not backends.triton_runs_on(facts.device):
        return f"the selected-attention kernels need a CUDA device, not {facts.device.type!r}"
    return None


def indexer_facts(index_q, index_k) -> dict:
    """The indexer's facts (``Facts.extra``) for :func:`indexer_kernels_refusal`."""
    return {"index_dtype": index_q.dtype, "index_heads": index_q.shape[2],
            "index_dim": index_q.shape[3], "index_key_elements": math.prod(index_k.shape[1:])}


def indexer_kernels_refusal(facts: registry.Facts) -> str | None:
    """Why triton_indexer.py's kernels cannot take the indexer's tensors, or None (the device
    is the callers' concern): index_q in fp32, bf16 or fp16, at most ``MAX_HEADS`` heads of at
    most ``MAX_DIM``, fewer than 2^31 elements in a batch row of index_k."""
    if "index_dtype" not in facts.extra:
        return None
    kernels, reason = _triton_module("triton_indexer")
    if kernels is None:
        return reason
    extra = facts.extra
    if extra["index_dtype"] not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the indexer-loss kernels take index_q in fp32, bf16 or fp16; got {extra['index_dtype']}"
    if extra["index_heads"] > kernels.MAX_HEADS or extra["index_dim"] > kernels.MAX_DIM:
        return (f"the indexer-loss kernels take up to {kernels.MAX_HEADS} indexer heads of dims "
                f"up to {kernels.MAX_DIM}; got {extra['index_heads']} of {extra['index_dim']}")
    if extra["index_key_elements"] >= 2**31:
        return (f"the indexer-loss kernels address a batch row's keys with 32-bit offsets; "
                f"S DI = {extra['index_key_elements']} is too many")
    return None


_FAILED = "failed its first-use check on this device in this dtype"


def flash_verified(facts: registry.Facts) -> str | None:
    """The verifier of the FlashAttention-2 path: its first-use check (``flash.checked``)."""
    return None if flash.checked(facts.device, facts.dtype) else _FAILED


def cudnn_verified(facts: registry.Facts) -> str | None:
    """The verifier of cuDNN's attention: its first-use check (``flash.cudnn_checked``)."""
    return None if flash.cudnn_checked(facts.device, facts.dtype) else f"cuDNN {_FAILED}"


def flash_and_cudnn_verified(facts: registry.Facts) -> str | None:
    return flash_verified(facts) or cudnn_verified(facts)


def selected_kernels_verified(facts: registry.Facts) -> str | None:
    """The verifier of triton.py's kernels: their first-use check (``triton.checked``)."""
    from . import triton as kernels

    return None if kernels.checked(facts.device, facts.dtype) else _FAILED


def either(*rules):
    """The rule that refuses where any of ``rules`` does (the first reason)."""
    def rule(facts):
        for each in rules:
            reason = each(facts)
            if reason is not None:
                return reason
        return None
    return rule


def unless(key: str, reason: str, expected=None):
    """The rule that refuses (``reason``) where ``facts.extra[key]`` is set (truthy), or, with
    ``expected``, differs from it."""
    def rule(facts):
        value = facts.extra.get(key)
        refused = bool(value) if expected is None else value != expected
        return reason if refused else None
    return rule


def flash_backend(function, unsupported=None, verify=flash_verified, limit=None,
                  cudnn=False) -> registry.Backend:
    """An op's flash backend (flash.py): where FlashAttention-2's rule (:func:`flash_refusal`),
    with ``cudnn`` cuDNN's (:func:`cudnn_refusal`), and the op's own ``unsupported`` allow;
    "auto" on CUDA, below its ``limit``, once ``verify`` (its first-use checks) passed. The rules
    are read from this module when a call asks (tests put the emulated kernels in place)."""
    def refusal(facts: registry.Facts) -> str | None:
        return (flash_refusal(facts) or (cudnn_refusal(facts) if cudnn else None)
                or (None if unsupported is None else unsupported(facts)))

    return registry.Backend("flash", function, unsupported=refusal, verify=verify,
                            auto_devices=("cuda",), auto_limit=limit)


def layout_backends(reference, flash_function=None, flash_unsupported=None, flash_limit=None,
                    gathered_unsupported=None) -> dict[str, registry.Backend]:
    """The backends of an op on the block layouts: its reference, the layout in PyTorch
    (gathered, any device) and in FlexAttention (flex: "auto" on CUDA), and where given its
    FlashAttention-2 path (:func:`flash_backend`)."""
    backends = {
        "reference": registry.Backend("reference", reference),
        "gathered": registry.Backend("gathered", gathered_attention, unsupported=gathered_unsupported),
        "flex": registry.Backend("flex", flex_attention_layout, unsupported=flex_refusal,
                                 auto_devices=("cuda",)),
    }
    if flash_function is not None:
        backends["flash"] = flash_backend(flash_function, flash_unsupported, limit=flash_limit)
    return backends


_layouts = layout_backends(gathered_attention)
registry.declare(registry.Op(
    "block_layout", backends={name: _layouts[name] for name in ("gathered", "flex")},
    auto=("flex", "gathered"), facts=attention_facts))


def _blocks(name: str, layout_blocks, gathered_default=(64, 64)):
    if layout_blocks is not None:
        return layout_blocks
    return (128, 128) if name == "flex" else gathered_default


def _check_sink(sink, q):
    if sink is not None and tuple(sink.shape) != (q.shape[2],):
        raise ValueError(f"{OP}: sink has shape {tuple(sink.shape)}, expected [Hq] = "
                         f"[{q.shape[2]}] (one logit per query head)")


def _check_top_k(top_k: int, num_blocks: int, what: str):
    if top_k > num_blocks:
        raise ValueError(f"{OP}: {what}: top_k={top_k} is more than the {num_blocks} blocks of "
                         "the sequence")
