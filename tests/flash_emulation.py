"""A PyTorch emulation of what the two FlashAttention-2 kernels of kernels/sparse/flash.py
compute, for CPU tests: the forward's output and natural-log log-sum-exp ``[H, total_q]``, and
the backward's gradients from the output and log-sum-exp it is given, with
``D = rowsum(dO * O)``; packed sequences (separate query and key bounds, aligned at their ends
as FlashAttention aligns them; query rows past the last sequence left alone), causal masks,
windows and grouped heads. :func:`emulate` puts it in
place of the kernels; :func:`emulate_cudnn` also puts it in place of the cuDNN calls of a block
selection (``[N, H, L, D]`` batches, log-sum-exp ``[N, H, L]``: the own blocks causal, the
earlier blocks' chunks not) and makes every selection whose blocks are all full take them, and
cuDNN's call with a bias (DSA's causal selection: dense scores plus the bias), whose bias it
makes in PyTorch (the Triton kernel's own test is tests/ops/test_sparse_select.py's)."""
import dataclasses

import torch

from megatron_ext.kernels import registry
from megatron_ext.kernels.sparse import flash, reference, routing

# The sparse ops with a flash backend (flash.py) in the backend registry.
FLASH_OPS = ("softmax_attention", "moba_attention", "nsa_attention", "dsa_attention", "csa_attention")


def allow_flash(monkeypatch, cudnn=False):
    """Let the sparse ops' flash backends take calls on the CPU (with the kernels emulated):
    FlashAttention-2's rule in the registry (``routing.flash_refusal``), and with ``cudnn``
    cuDNN's (``routing.cudnn_refusal``), allow every call, and "auto" considers flash on any
    device (the ops' own rules, such as MoBA's window, still apply)."""
    monkeypatch.setattr(routing, "flash_refusal", lambda facts: None)
    if cudnn:
        monkeypatch.setattr(routing, "cudnn_refusal", lambda facts: None)
    for op in FLASH_OPS:
        backends = registry.get(op).backends
        monkeypatch.setitem(backends, "flash", dataclasses.replace(backends["flash"], auto_devices=None))


def emulate(monkeypatch):
    monkeypatch.setattr(flash, "_kernel_forward", emulated_forward)
    monkeypatch.setattr(flash, "_kernel_backward", emulated_backward)


def emulate_cudnn(monkeypatch, earlier_chunk=0):
    """Also the cuDNN calls, taken as checked; the own blocks go to them wherever every block
    is full and, with ``earlier_chunk`` > 0 (which needs the Triton merge:
    ``flash.MERGE_DEVICE_TYPES``), the earlier blocks in chunks of that many slots."""
    emulate(monkeypatch)
    monkeypatch.setattr(flash, "_cudnn_forward", emulated_cudnn_forward)
    monkeypatch.setattr(flash, "_cudnn_backward", emulated_cudnn_backward)
    monkeypatch.setattr(flash, "_selection_bias", _selection_bias)
    monkeypatch.setattr(flash, "_on_cudnn", lambda q: True)
    monkeypatch.setattr(flash, "cudnn_checked", lambda device, dtype: True)
    monkeypatch.setattr(flash, "_own_blocks_on_cudnn",
                        lambda q, block_len: q.shape[1] % block_len == 0)
    monkeypatch.setattr(flash, "_earlier_blocks_on_cudnn", lambda q, block_len: earlier_chunk > 0)
    if earlier_chunk:
        monkeypatch.setattr(flash, "CUDNN_CHUNK", earlier_chunk)


def _batch_as_rows(x):
    """``[N, H, L, D]`` -> packed rows ``[N * L, H, D]`` and their sequence bounds."""
    n, _, length, _ = x.shape
    rows = x.transpose(1, 2).reshape(n * length, *x.shape[1::2])
    return rows, torch.arange(0, n * length + 1, length)


def _selection_bias(selected, key_len, dtype):
    listed = reference.selected_mask(selected, key_len)[:, None]
    return torch.zeros(listed.shape, dtype=dtype).masked_fill(~listed, float("-inf"))


def _dense_scores(q, k, scale, causal, bias):
    """Scaled scores ``[N, H, L, S]`` plus the bias (-inf after the query where causal)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = scale * torch.einsum("nhld,nhsd->nhls", q, k) + bias
    if causal:
        after = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(after, float("-inf"))
    return scores, scale


def _dense_forward(q, k, v, scale, causal, bias):
    dtype = q.dtype
    q, k, v, bias = _wide(q, k, v, bias)
    scores, _ = _dense_scores(q, k, scale, causal, bias)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row without keys: 0
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.einsum("nhls,nhsd->nhld", probs, v).to(dtype), lse, "state"


def _dense_backward(d_out, q, k, v, out, lse, scale, causal, bias):
    dtypes = (q.dtype, k.dtype, v.dtype)
    d_out, q, k, v, out, bias = _wide(d_out, q, k, v, out, bias)
    scores, scale = _dense_scores(q, k, scale, causal, bias)
    group = q.shape[1] // k.shape[1]
    probs = torch.exp(scores - lse[..., None])  # recomputed from the lse given
    d_probs = torch.einsum("nhld,nhsd->nhls", d_out, v.repeat_interleave(group, dim=1))
    d_scores = probs * (d_probs - (d_out * out).sum(-1)[..., None])
    dq = scale * torch.einsum("nhls,nhsd->nhld", d_scores, k.repeat_interleave(group, dim=1))
    dk = scale * torch.einsum("nhls,nhld->nhsd", d_scores, q)
    dv = torch.einsum("nhls,nhld->nhsd", probs, d_out)
    dk, dv = (x.unflatten(1, (k.shape[1], group)).sum(2) for x in (dk, dv))
    return [g.to(dtype) for g, dtype in zip((dq, dk, dv), dtypes)]


def emulated_cudnn_forward(q, k, v, scale, causal=True, bias=None):
    if bias is not None:
        return _dense_forward(q, k, v, scale, causal, bias)
    (q_rows, cu_q), (k_rows, cu_k), (v_rows, _) = (_batch_as_rows(x) for x in (q, k, v))
    out, lse = emulated_forward(q_rows, k_rows, v_rows, cu_q, cu_k, 0, 0, causal, -1,
                                0 if causal else -1, scale)
    n, heads, length, dim = q.shape
    return (out.view(n, length, heads, dim).transpose(1, 2),
            lse.view(heads, n, length).transpose(0, 1), "state")


def emulated_cudnn_backward(d_out, q, k, v, out, lse, state, scale, causal=True, bias=None):
    assert state == "state"
    if bias is not None:
        return _dense_backward(d_out, q, k, v, out, lse, scale, causal, bias)
    (d_rows, cu_q), (q_rows, _), (k_rows, cu_k), (v_rows, _), (out_rows, _) = (
        _batch_as_rows(x) for x in (d_out, q, k, v, out))
    assert lse.shape == q.shape[:3]
    lse_rows = lse.transpose(0, 1).reshape(q.shape[1], -1)
    grads = emulated_backward(d_rows, q_rows, k_rows, v_rows, out_rows, lse_rows, cu_q, cu_k, 0,
                              0, causal, -1, 0 if causal else -1, scale)
    return [g.view(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)
            for g, x in zip(grads, (q, k, v))]


def _visible(cu_q, cu_k, causal, left, right):
    """bool ``[total_q, total_k]``: key j is in query i's sequence and window, FlashAttention's
    way: positions within the sequence, aligned at its end when q and k differ in length."""
    def segments(cu):
        total = int(cu[-1])
        ids = torch.searchsorted(cu[1:].long(), torch.arange(total), right=True)
        return ids, torch.arange(total) - cu.long()[ids]

    q_ids, q_pos = segments(cu_q)
    k_ids, k_pos = segments(cu_k)
    lengths_q, lengths_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    offset = (k_pos[None, :] - q_pos[:, None]) - (lengths_k - lengths_q)[q_ids][:, None]
    mask = q_ids[:, None] == k_ids[None, :]
    if causal:
        right = 0
    if left >= 0:
        mask &= offset >= -left
    if right >= 0:
        mask &= offset <= right
    return mask


def _scores(q, k, cu_q, cu_k, causal, left, right, scale):
    """Scaled scores ``[H, total_q, total_k]`` (-inf where not visible); k repeated per group."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = scale * torch.einsum("ihd,jhd->hij", q, k)
    return scores.masked_fill(~_visible(cu_q, cu_k, causal, left, right), float("-inf")), scale


def _wide(*tensors):
    """The tensors in fp32 at least (the kernels accumulate in fp32)."""
    return [x.to(torch.promote_types(x.dtype, torch.float32)) for x in tensors]


def _padded(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """x with NaN rows appended along ``dim`` up to ``rows``: FlashAttention computes nothing for
    the query rows past ``cu_q[-1]`` (a block selection's padding) and leaves them
    uninitialised; NaN there makes a read of them show."""
    missing = rows - x.shape[dim]
    if not missing:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, float("nan"))], dim)


def emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    dtype, rows, total = q.dtype, q.shape[0], int(cu_q[-1])
    q, k, v = _wide(q[:total], k, v)
    scores, _ = _scores(q, k, cu_q, cu_k, causal, left, right, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [H, total_q]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row without keys: 0
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hij,jhd->ihd", probs, v).to(dtype)
    return _padded(out, rows), _padded(lse, rows, dim=1)


def emulated_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right,
                      scale):
    dtypes, rows, total = (q.dtype, k.dtype, v.dtype), q.shape[0], int(cu_q[-1])
    d_out, q, out, lse = d_out[:total], q[:total], out[:total], lse[:, :total]
    d_out, q, k, v, out = _wide(d_out, q, k, v, out)
    scores, scale = _scores(q, k, cu_q, cu_k, causal, left, right, scale)
    group = q.shape[1] // k.shape[1]
    probs = torch.exp(scores - lse[..., None])  # recomputed from the lse given
    v_rep = v.repeat_interleave(group, dim=1)
    k_rep = k.repeat_interleave(group, dim=1)
    d_probs = torch.einsum("ihd,jhd->hij", d_out, v_rep)
    delta = (d_out * out).sum(-1).t()  # [H, total], from the output given
    d_scores = probs * (d_probs - delta[..., None])
    dq = scale * torch.einsum("hij,jhd->ihd", d_scores, k_rep)
    dk = scale * torch.einsum("hij,ihd->jhd", d_scores, q)
    dv = torch.einsum("hij,ihd->jhd", probs, d_out)

    def per_kv_head(x):
        return x.unflatten(1, (k.shape[1], group)).sum(2)

    grads = (_padded(dq, rows), per_kv_head(dk), per_kv_head(dv))
    return [grad.to(dtype) for grad, dtype in zip(grads, dtypes)]
