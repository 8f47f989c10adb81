"""What every first-use check and the self-check share: the error measure and the verdict.

A fast path (a Triton kernel, FlashAttention, cuDNN) runs on a device only after its first-use
check there has compared it with its reference (:func:`passes_first_use_check`); errors are
relative, in the Frobenius norm (:func:`relative_error`). This module imports no op package, so
that every op package and the self-check (``selfcheck.py``) can import it.
"""
import torch

__all__ = ["passes_first_use_check", "relative_error"]


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in fp64 on the CPU (the absolute norm where the
    expected tensor is zero)."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    norm = expected.norm().item()
    return (actual - expected).norm().item() / (norm if norm > 0 else 1.0)


def passes_first_use_check(check, device, dtype, tolerance: float, kernels: str, instead: str,
                           log) -> bool:
    """Whether ``check(device, dtype)`` (a first-use check returning its errors by name)
    raises nothing and gives errors within ``tolerance``; else ``log`` warns, naming the
    ``kernels`` and what runs ``instead``, and the answer is False. The check runs with autograd
    on and autocast off, whatever the caller's mode: a first use inside ``torch.no_grad()``
    (generation, evaluation) checks the backward too, and its verdict is kept for training."""
    try:
        with torch.autocast(torch.device(device).type, enabled=False), torch.enable_grad():
            errors = check(device, dtype)
    except Exception as error:  # noqa: BLE001 - a check that cannot run fails
        log.warning("megatron-ext: the first-use check of %s failed on %s in %s (%s: %s); %s",
                    kernels, device, dtype, type(error).__name__, error, instead)
        return False
    over = {name: f"{error:.2e}" for name, error in errors.items() if not error <= tolerance}
    if over:
        log.warning("megatron-ext: the first-use check of %s failed on %s in %s (errors over %s: "
                    "%s); %s", kernels, device, dtype, tolerance, over, instead)
    return not over
