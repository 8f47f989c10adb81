"""Autograd entry points of the fused layer pieces (short conv, gates, gated RMSNorm, RMSNorm,
RoPE, vocab-parallel cross-entropy), with ``backend="auto"|"reference"|"triton"``.

Each op is declared in the backend registry (``kernels.registry``): "auto" runs the Triton
kernels on CUDA tensors they take (whose head dim, the L2-normalised group or the normalised
head, is a power of two; filters of up to four taps; ...), once they have passed a first-use
check on that GPU (:func:`first_use_check`: forward and backward against the fp32 reference on
small shapes with packed sequences, odd lengths and the L2 norm, in the call's dtype; once per
process, device and dtype), and the PyTorch reference otherwise; a failed check is logged once,
and so is each choice. "triton" named by the caller refuses inputs the kernels do not take
(``registry.BackendUnavailable``).
"""
from __future__ import annotations

import functools
import logging

import torch

from .. import registry
from ..first_use import passes_first_use_check, relative_error
from . import reference

logger = logging.getLogger("megatron_ext.kernels")

# Relative errors (Frobenius) the first-use check allows, per dtype of the inputs: the kernels
# compute in fp32, so the fp32 bound is rounding; bf16 outputs round once more.
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _triton():
    from . import triton as kernels

    return kernels


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, positions, l2_norm_dim, grad_into):
        ctx.save_for_backward(x, weight, positions)
        ctx.l2_norm_dim, ctx.grad_into = l2_norm_dim, grad_into
        return _triton().short_conv_forward(x, weight, positions, l2_norm_dim)

    @staticmethod
    def backward(ctx, dy):
        x, weight, positions = ctx.saved_tensors
        dx = None if ctx.grad_into is None else ctx.grad_into()
        dx, dw = _triton().short_conv_backward(x, weight, positions, ctx.l2_norm_dim, dy, dx)
        return dx, dw, None, None, None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, weight, gate, eps, sequence_first, gate_grad_into, gate_first):
        batch, length, heads, dim = o.shape
        if sequence_first:
            out = torch.empty(length, batch, heads * dim, device=o.device, dtype=o.dtype)
            view = out.transpose(0, 1).unflatten(-1, (heads, dim))
        else:
            out = view = torch.empty_like(o, memory_format=torch.contiguous_format)
        _triton().gated_rms_norm_forward(o, weight, gate, eps, view, gate_first)
        ctx.save_for_backward(o, weight, gate)
        ctx.eps, ctx.sequence_first, ctx.gate_grad_into = eps, sequence_first, gate_grad_into
        ctx.gate_first = gate_first
        return out

    @staticmethod
    def backward(ctx, dy):
        o, weight, gate = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.sequence_first:
            dy = dy.transpose(0, 1).unflatten(-1, o.shape[2:])
        dgate = None if ctx.gate_grad_into is None else ctx.gate_grad_into()
        do, dgate, dweight = _triton().gated_rms_norm_backward(o, weight, gate, ctx.eps, dy, dgate,
                                                               ctx.gate_first)
        return do, dweight, dgate, None, None, None, None


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, A_log, dt_bias, grad_into):
        ctx.save_for_backward(x, A_log, dt_bias)
        ctx.grad_into = grad_into
        return _triton().gate_forward(x, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dy):
        x, A_log, dt_bias = ctx.saved_tensors
        dx = None if ctx.grad_into is None else ctx.grad_into()
        return (*_triton().gate_backward(x, A_log, dt_bias, dy, dx), None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = _triton().rms_norm_forward(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = _triton().rms_norm_backward(rows, weight, rstd, dy.reshape(rows.shape))
        return dx.view(dy.shape), dw, None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _triton().rope_forward(_dense_last(t), freqs)

    @staticmethod
    def backward(ctx, dy):
        freqs, = ctx.saved_tensors
        return _triton().rope_forward(_dense_last(dy), freqs, inverse=True), None


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, backend):
        pieces = _triton() if backend == "triton" else reference
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
        flat = target.reshape(-1).contiguous()
        loss, lse = merge_vocab_shards(pieces.cross_entropy_stats(rows, flat, vocab_start), group)
        ctx.save_for_backward(rows, flat, lse)
        ctx.vocab_start, ctx.pieces, ctx.shape = vocab_start, pieces, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, dloss):
        rows, flat, lse = ctx.saved_tensors
        dloss = dloss.reshape(-1).float().contiguous()
        grad = ctx.pieces.cross_entropy_grad(rows, flat, lse, dloss, ctx.vocab_start)
        return grad.view(ctx.shape), None, None, None, None


class ProjectionGradient:
    """The gradient of a fused projection's output ``[s, b, W]``, one buffer that the consumers
    of its parts (column slices ``[s, b, w_i]``, :func:`split_projection`) write their input
    gradients into, so that no concatenation of the parts' gradients is needed: the short
    convolution and the gated RMSNorm do, given ``grad_into=gradient.part_of(i)``. The buffer is
    allocated by the first backward that asks for it and handed over by the split's backward,
    which copies in the gradients that did not arrive in place (other consumers, the reference
    paths) and zeros those of unused parts."""

    def __init__(self, output: torch.Tensor, widths: list[int]):
        self.widths = list(widths)
        self._shape, self._dtype, self._device = output.shape, output.dtype, output.device
        self._whole: torch.Tensor | None = None

    def _parts(self) -> tuple[torch.Tensor, ...]:
        if self._whole is None:
            self._whole = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return self._whole.split(self.widths, dim=-1)

    def part_of(self, index: int, view=None):
        """A function (for ``grad_into``) returning part ``index``'s slice of the buffer, through
        ``view`` (the consumer's layout of the part, e.g. a transpose) where given."""
        return lambda: self._parts()[index] if view is None else view(self._parts()[index])

    def take(self, grads) -> torch.Tensor:
        """The whole gradient from the parts' gradients (None: unused), which may already lie in
        the buffer; the buffer is released."""
        for part, grad in zip(self._parts(), grads):
            if grad is None:
                part.zero_()
            elif not (grad.data_ptr() == part.data_ptr() and grad.shape == part.shape
                      and grad.stride() == part.stride()):
                part.copy_(grad)
        whole, self._whole = self._whole, None
        return whole


class _SplitProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, gradient):
        ctx.gradient = gradient
        ctx.set_materialize_grads(False)  # an unused part's gradient arrives as None
        return output.split(gradient.widths, dim=-1)

    @staticmethod
    def backward(ctx, *grads):
        return ctx.gradient.take(grads), None


def split_projection(output: torch.Tensor, widths: list[int]):
    """``output [..., sum(widths)]`` split into column slices (views), and the
    :class:`ProjectionGradient` their consumers may write their input gradients into."""
    gradient = ProjectionGradient(output, widths)
    return _SplitProjection.apply(output, gradient), gradient


def merge_vocab_shards(stats: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, log-sum-exp), fp32 ``[N]`` each, from the ranks' :func:`reference.cross_entropy_stats`
    ``[N, 3]`` over their columns of the vocabulary: the max over the ranks, each rank's sum
    rescaled to it and summed with the target logits (one all-reduce each, as Megatron's)."""
    peak, total, picked = stats.unbind(-1)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        top = peak.clone()
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        sums = torch.stack([total * torch.exp(peak - top), picked])
        torch.distributed.all_reduce(sums, group=group)
        peak, (total, picked) = top, sums
    lse = peak + torch.log(total)
    return lse - picked, lse


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _facts(x: torch.Tensor, **extra) -> registry.Facts:
    return registry.Facts(device=x.device, dtype=x.dtype, extra=extra)


def _triton_verified(facts: registry.Facts) -> str | None:
    """The verifier of every fused op's Triton backend: the kernels' one first-use check on the
    device in the call's dtype (:func:`first_use_check`)."""
    if facts.dtype not in CHECK_TOLERANCE:
        return f"the first-use check covers {', '.join(map(str, CHECK_TOLERANCE))}, not {facts.dtype}"
    return None if first_use_check(facts.device, facts.dtype) else "failed its first-use check"


def _declare(name: str, facts, reference_function, triton_function, unsupported=None) -> None:
    """Declare a fused op: the Triton kernels on CUDA once they passed their first-use check
    there, for the calls they take (``unsupported``), else the reference."""
    registry.declare(registry.Op(
        name,
        backends={"reference": registry.Backend("reference", reference_function),
                  "triton": registry.Backend("triton", triton_function, unsupported=unsupported,
                                             verify=_triton_verified, auto_devices=("cuda",))},
        auto=("triton", "reference"),
        facts=facts,
    ))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _short_conv_unsupported(facts: registry.Facts) -> str | None:
    l2_norm_dim, taps = facts.extra["l2_norm_dim"], facts.extra["taps"]
    if l2_norm_dim is not None and not _power_of_two(l2_norm_dim):  # one head is one kernel tile
        return (f"an L2-normalised group of {l2_norm_dim} channels (the Triton kernels take "
                "powers of two)")
    if taps > _triton().CONV_MAX_TAPS:
        return (f"filters of {taps} taps (linear_conv_kernel; the Triton kernels take at most "
                f"{_triton().CONV_MAX_TAPS} taps)")
    return None


_declare("short_conv",
         lambda x, weight, positions=None, l2_norm_dim=None, grad_into=None: _facts(
             x, l2_norm_dim=l2_norm_dim, taps=weight.shape[1]),
         lambda x, weight, positions=None, l2_norm_dim=None, grad_into=None: reference.short_conv(
             x, weight, positions, l2_norm_dim),
         lambda x, weight, positions=None, l2_norm_dim=None, grad_into=None: _ShortConv.apply(
             x, weight, positions, l2_norm_dim, grad_into),
         _short_conv_unsupported)


def short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None,
               l2_norm_dim: int | None = None, backend: str = "auto",
               grad_into=None) -> torch.Tensor:
    """Causal depthwise conv + SiLU (+ L2 norm per ``l2_norm_dim`` channels), see
    :func:`reference.short_conv`. ``x [B, T, C]`` in any strides; returns ``[B, T, C]``
    contiguous in ``x.dtype``; the gradient of ``x`` comes back in ``x``'s strides, or, where the
    Triton kernel runs and ``grad_into`` is given, in the tensor of ``x``'s shape that
    ``grad_into()`` returns when the backward runs (see :class:`ProjectionGradient`). The Triton
    kernels take filters of up to ``CONV_MAX_TAPS`` (4) taps and L2-normalised groups of a power
    of two channels; "auto" runs the reference for others (and says so once)."""
    return registry.call("short_conv", backend, x, weight, positions, l2_norm_dim,
                         grad_into=grad_into)


def _gate_unsupported(facts: registry.Facts) -> str | None:
    if facts.extra["channel_stride"] != 1:
        return f"a channel dim of stride {facts.extra['channel_stride']} (the Triton kernels read it dense)"
    return None


_declare("gate",
         lambda x, A_log=None, dt_bias=None, grad_into=None: _facts(x, channel_stride=x.stride(-1)),
         lambda x, A_log=None, dt_bias=None, grad_into=None: reference.gate(x, A_log, dt_bias),
         lambda x, A_log=None, dt_bias=None, grad_into=None: _Gate.apply(x, A_log, dt_bias, grad_into),
         _gate_unsupported)


def gate(x: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
         backend: str = "auto", grad_into=None) -> torch.Tensor:
    """A gate activation in fp32, see :func:`reference.gate`: ``sigmoid(x)``, or with ``A_log
    [N / C]`` and ``dt_bias [N]`` the log-decay ``-exp(A_log) softplus(x + dt_bias)``. ``x [B,
    T, N]`` with a dense last dim, any batch and token strides (a transposed slice of a fused
    projection's ``[s, b, W]`` output is read in place); returns ``[B, T, N]`` (contiguous from
    the Triton kernel). ``grad_into``: as :func:`short_conv`'s."""
    return registry.call("gate", backend, x, A_log, dt_bias, grad_into=grad_into)


def _gated_rms_norm_unsupported(facts: registry.Facts) -> str | None:
    if not _power_of_two(facts.extra["head_dim"]):
        return f"a head dim of {facts.extra['head_dim']} (the Triton kernels take powers of two)"
    if facts.extra["channel_strides"] != (1, 1):
        return (f"o and gate with channel strides {facts.extra['channel_strides']} (the Triton "
                "kernels read them dense)")
    return None


def _gated_rms_norm_reference(o, weight, gate, eps, sequence_first=False, gate_grad_into=None,
                              gate_first=False):
    out = reference.gated_rms_norm(o, weight, gate, eps, gate_first)
    return out.transpose(0, 1).flatten(2).contiguous() if sequence_first else out


_declare("gated_rms_norm",
         lambda o, weight, gate, eps, sequence_first=False, gate_grad_into=None, gate_first=False:
         _facts(o, head_dim=o.shape[-1], channel_strides=(o.stride(-1), gate.stride(-1))),
         _gated_rms_norm_reference,
         lambda o, weight, gate, eps, sequence_first=False, gate_grad_into=None, gate_first=False:
         _GatedRMSNorm.apply(o, weight, gate, eps, sequence_first, gate_grad_into, gate_first),
         _gated_rms_norm_unsupported)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   sequence_first: bool = False, backend: str = "auto",
                   gate_grad_into=None, gate_first: bool = False) -> torch.Tensor:
    """``rmsnorm(o) * weight * silu(gate)`` per head, or with ``gate_first`` Mamba-2's
    ``rmsnorm(o * silu(gate)) * weight``, see :func:`reference.gated_rms_norm`.
    ``o``, ``gate``: ``[B, T, H, D]`` (any strides with a dense last dim); ``weight``: ``[H, D]``
    or ``[D]``. Returns ``[B, T, H, D]``, or with ``sequence_first`` Megatron's ``[T, B, H*D]``
    (contiguous, ready for the output projection), in ``o.dtype``. ``gate_grad_into``: as
    :func:`short_conv`'s ``grad_into``, for the gate's gradient."""
    return registry.call("gated_rms_norm", backend, o, weight, gate, eps, sequence_first,
                         gate_grad_into=gate_grad_into, gate_first=gate_first)


_declare("rms_norm", lambda x, weight, eps: _facts(x),
         lambda x, weight, eps: reference.rms_norm(x, weight, eps),
         lambda x, weight, eps: _RMSNorm.apply(x, weight, eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim, see :func:`reference.rms_norm`: ``x [..., N]``, ``weight
    [N]`` -> ``x``'s shape and dtype; "auto" runs the Triton kernels on CUDA after the
    first-use check."""
    return registry.call("rms_norm", backend, x, weight, eps)


_declare("cross_entropy", lambda logits, target, vocab_start=0, group=None: _facts(logits),
         lambda logits, target, vocab_start=0, group=None: _CrossEntropy.apply(
             logits, target, vocab_start, group, "reference"),
         lambda logits, target, vocab_start=0, group=None: _CrossEntropy.apply(
             logits, target, vocab_start, group, "triton"))


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, group=None,
                  backend: str = "auto") -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` (fp32) of ``logits [..., V]`` holding columns
    ``vocab_start .. vocab_start + V`` of the vocabulary (this rank's share under Megatron's
    vocab-parallel output layer; ``group``: the ranks holding the rest, or None) against
    ``target [...]``, see :func:`reference.cross_entropy`; the gradient comes back in
    ``logits.dtype``. "auto" runs the Triton kernels on CUDA after the first-use check."""
    return registry.call("cross_entropy", backend, logits, target, vocab_start, group)


def rope_fits(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether :func:`rope`'s kernel takes these: ``t [s, b, H, D]`` and a table ``[s, 1, 1, D]``
    rotating every channel, with D/2 a power of two."""
    return (t.dim() == 4 and freqs.dim() == 4 and freqs.shape[0] == t.shape[0]
            and freqs.shape[1:3] == (1, 1) and freqs.shape[-1] == t.shape[-1]
            and t.shape[-1] % 2 == 0 and _power_of_two(t.shape[-1] // 2))


def _rope_unsupported(facts: registry.Facts) -> str | None:
    if not facts.extra["fits"]:
        return (f"t {facts.extra['shapes'][0]} with freqs {facts.extra['shapes'][1]} (the Triton "
                "kernel takes t [s, b, H, D] and freqs [s, 1, 1, D] with D/2 a power of two)")
    return None


_declare("rope",
         lambda t, freqs: _facts(t, fits=rope_fits(t, freqs),
                                 shapes=(list(t.shape), list(freqs.shape))),
         lambda t, freqs: reference.rope(t, freqs),
         lambda t, freqs: _Rope.apply(t, freqs),
         _rope_unsupported)


def rope(t: torch.Tensor, freqs: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Rotary position embedding, see :func:`reference.rope`: ``t [s, b, H, D]`` (any strides),
    ``freqs [s, 1, 1, D]`` -> ``[s, b, H, D]`` contiguous in ``t.dtype``. The Triton kernel takes
    what :func:`rope_fits`; "auto" runs it on CUDA after the first-use check."""
    return registry.call("rope", backend, t, freqs)


@functools.cache
def first_use_check(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels give the reference's outputs and gradients on ``device`` in
    ``dtype`` (:func:`check_errors` within :data:`CHECK_TOLERANCE`); a failure is logged once
    and the PyTorch reference runs instead."""
    return passes_first_use_check(
        check_errors, device, dtype, CHECK_TOLERANCE[dtype],
        "the fused layer kernels (short_conv, gate, gated_rms_norm, rms_norm, rope, "
        "cross_entropy)",
        "the PyTorch reference runs instead", logger)


def check_errors(device, dtype: torch.dtype) -> dict[str, float]:
    """Relative errors of the Triton kernels against the fp32 reference, forward and backward:
    the short convolution over a transposed ``[s, b, C]`` input (T = 45, odd and across the
    kernels' token blocks), with and without the L2 norm, over a slice of a wider projection,
    and on three packed sequences (5, 33 and 7 tokens); RMSNorm over 48 channels; RoPE on a
    strided slice; the gated RMSNorm with per-head and shared weights, both output layouts;
    cross-entropy over a vocabulary shard that holds some of the targets; the short conv and
    the gated RMSNorm writing their input gradients into a split projection's gradient; the
    sigmoid and log-decay gates on a strided slice; the gated RMSNorm with the gate first."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    errors = {}

    def compare(name, fast, slow, inputs):
        """Outputs and input gradients of fast (on device) and slow (fp32 reference on CPU)."""
        probe = randn(*slow(*[t.float() if t.is_floating_point() else t for t in inputs]).shape)
        results = []
        for function, where, cast in ((fast, device, lambda t: t), (slow, "cpu", lambda t: t.float())):
            args = [cast(t).to(where).detach().clone().requires_grad_(t.is_floating_point())
                    for t in inputs]
            out = function(*args)
            (out.float() * probe.to(where).float()).sum().backward()
            results.append([out] + [a.grad for a in args if a.is_floating_point()])
        for i, (a, b) in enumerate(zip(*results)):
            errors[name if i == 0 else f"grad_{i} {name}"] = relative_error(a.float(), b)

    batch, length, heads, dim = 2, 45, 3, 16
    x = randn(length, batch, heads * dim).transpose(0, 1)  # Megatron's layout, read in place
    # A part of a fused projection's output: a strided slice of [s, b, wider].
    part = randn(length, batch, 8 + heads * dim)[..., 8:].transpose(0, 1)
    weight = randn(heads * dim, 4, scale=0.5)
    for l2, inputs in ((None, x), (dim, x), (dim, part)):
        compare(f"short_conv l2={l2}{' slice' if inputs is part else ''}",
                lambda x, w: short_conv(x, w, None, l2, backend="triton"),
                lambda x, w: reference.short_conv(x, w, None, l2), [inputs, weight])
    cu_seqlens = torch.tensor([0, 5, 38, 45], dtype=torch.int32)
    positions = reference.sequence_positions(cu_seqlens, length, "cpu")
    compare("short_conv packed",
            lambda x, w: short_conv(x, w, positions.to(device), dim, backend="triton"),
            lambda x, w: reference.short_conv(x, w, positions, dim), [x[:1], weight])

    # RMSNorm over a width that is not a power of two, rows across the kernels' row tiles.
    hidden = randn(length, batch, 3 * dim)
    compare("rms_norm", lambda x, w: rms_norm(x, w, 1e-5, "triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-5), [hidden, randn(3 * dim, scale=0.3) + 1])

    # RoPE on a strided [s, b, H, D] slice of a wider projection, angles up to 45 * 1 rad.
    qkv = randn(length, batch, 2 * heads, dim)
    angles = (torch.arange(length, dtype=torch.float32)[:, None]
              * torch.logspace(0, -3, dim // 2)).repeat(1, 2).view(length, 1, 1, dim)
    compare("rope", lambda t: rope(t, angles.to(device), "triton"),
            lambda t: reference.rope(t, angles), [qkv[:, :, :heads]])

    # Cross-entropy over 2,500 columns (a partial last block) that are columns 1,000.. of the
    # vocabulary: targets inside and outside them.
    logits = randn(length, batch, 2500, scale=3.0)
    target = torch.randint(0, 4500, (length, batch), generator=gen)
    compare("cross_entropy", lambda x: cross_entropy(x, target.to(device), 1000, None, "triton"),
            lambda x: cross_entropy(x, target, 1000, None, "reference"), [logits])

    # A fused projection's output split four ways: the short conv and the gated RMSNorm write
    # their input gradients into its gradient buffer, another consumer's gradient is copied in,
    # the unused part's is zero.
    widths = [8, heads * dim, heads * dim, 5]
    o = randn(batch, length, heads, dim)

    def heads_of(t):  # [s, b, H * D] -> [b, s, H, D]
        return t.transpose(0, 1).unflatten(-1, (heads, dim))

    def through_projection(conv, norm, split):
        def run(wide, w, o, norm_weight):
            (other, part, gate_part, _), gradient = split(wide)
            y = conv(part.transpose(0, 1), w, gradient.part_of(1, lambda t: t.transpose(0, 1)))
            z = norm(o, norm_weight, heads_of(gate_part), gradient.part_of(2, heads_of))
            return torch.cat([y.flatten(), z.flatten(), (other * 2).flatten()])
        return run

    def plain_split(wide):
        return wide.split(widths, dim=-1), ProjectionGradient(wide, widths)

    compare("projection gradient",
            through_projection(
                lambda x, w, into: short_conv(x, w, None, dim, "triton", grad_into=into),
                lambda o, nw, g, into: gated_rms_norm(o, nw, g, 1e-6, False, "triton", into),
                lambda wide: split_projection(wide, widths)),
            through_projection(
                lambda x, w, into: reference.short_conv(x, w, None, dim),
                lambda o, nw, g, into: reference.gated_rms_norm(o, nw, g, 1e-6), plain_split),
            [randn(length, batch, sum(widths)), weight, o, randn(heads, dim, scale=0.3) + 1])

    # Gates on a transposed slice of a wider projection: the sigmoid, and log-decays with one
    # value per head (A_log and dt_bias of 5 heads) and per channel (3 heads of 16 channels).
    wide = randn(length, batch, 8 + heads * dim)
    compare("gate sigmoid", lambda x: gate(x, backend="triton"), reference.gate,
            [wide[..., 8:].transpose(0, 1)])
    for decay_heads, width in ((5, 5), (heads, heads * dim)):
        compare(f"gate decay {decay_heads} heads x {width // decay_heads}",
                lambda x, a, dt: gate(x, a, dt, backend="triton"), reference.gate,
                [wide[..., 8:8 + width].transpose(0, 1) * 8, randn(decay_heads, scale=0.5),
                 randn(width)])

    gate_input = randn(length, batch, heads * dim).transpose(0, 1).unflatten(-1, (heads, dim))
    for shape in ((heads, dim), (dim,)):
        norm_weight = randn(*shape, scale=0.3) + 1
        for sequence_first in (False, True):
            compare(f"gated_rms_norm w{list(shape)} sequence_first={sequence_first}",
                    lambda o, w, g: gated_rms_norm(o, w, g, 1e-6, sequence_first, "triton"),
                    lambda o, w, g: gated_rms_norm(o, w, g, 1e-6, sequence_first, "reference"),
                    [o, norm_weight, gate_input])
    compare("gated_rms_norm gate first",  # Mamba-2's order, per-head weights, sequence-first
            lambda o, w, g: gated_rms_norm(o, w, g, 1e-6, True, "triton", gate_first=True),
            lambda o, w, g: gated_rms_norm(o, w, g, 1e-6, True, "reference", gate_first=True),
            [o, randn(heads, dim, scale=0.3) + 1, gate_input])
    return errors
