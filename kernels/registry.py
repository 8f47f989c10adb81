"""The backend registry: each op's backends, what each takes, how each is verified, and the one
choice behind ``backend="auto"``.

An op package declares its op once, next to its functions (:func:`declare`): its backends, each
with its function, why it cannot take a call (``unsupported``: device, dtype, head dims, input
form, packing; read off the call as :class:`Facts`), the devices ``"auto"`` and the self-check
use it on (``auto_devices``), and its verifier (``verify``: the Triton self-check of
``backends.triton_verdict``, or a first-use check through ``first_use.passes_first_use_check``),
and the order in which ``"auto"`` prefers them. Everything else reads that declaration: the op's
entry point (:func:`call`, :func:`choose`), the backends' own refusals when called directly
(:func:`require`), and the self-check and ``megatron-ext doctor`` (``selfcheck.py``).

The choice (:func:`choose`) is deterministic: a backend named by the caller (from a config:
``ExtConfig.kernel_backend``) runs if it can take the call and raises :class:`BackendUnavailable`
with the reason otherwise; so does one named for the op in the override table (:func:`override`,
from ``ExtConfig.kernel_overrides``) where the call asks for ``"auto"``; ``"auto"`` otherwise
runs the first backend of the op's preference that runs on the device, takes the call, is not
past its ``auto_limit`` and has passed its verifier there, and logs what it chose once per (op,
device, dtype, choice). The verdicts are cached by the
verifiers (per process, and the Triton self-check's on disk), so a call asks again for free.

This module imports no op package: the op packages import it (it is a leaf, like first_use.py
and cases.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AUTO", "Backend", "BackendUnavailable", "Facts", "Op", "call", "choose", "declare",
           "get", "named", "ops", "override", "require"]

logger = logging.getLogger("megatron_ext.kernels")

AUTO = "auto"


class BackendUnavailable(RuntimeError, ValueError):
    """A backend asked for by name cannot take the call: ``"<op>: backend '<name>' cannot run
    <reason>"``. A RuntimeError (the self-check reports it as a skip, not a failure) and a
    ValueError (what the backends raised for head dims and filter widths they do not take)."""


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the backend choice knows of a call. None: not known (no backend objects to it), as
    when the self-check asks what "auto" runs on a device for any input."""
    device: torch.device
    dtype: torch.dtype | None = None          # the call's dtype (q's, or x's); its log names it
    compute_dtype: torch.dtype | None = None  # promoted over the inputs the kernels read (q, k, v)
    key_dim: int | None = None                # K (the recurrences)
    value_dim: int | None = None              # V
    form: str | None = None                   # the op's input form, e.g. "kda" (cases.py)
    packed: bool = False                      # sequences packed along T (cu_seqlens)
    requires_grad: bool = False               # a backward will run
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the op's own (filter taps, ...)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    function: Callable
    # Why it cannot take the call (the reason, worded to follow "cannot run "), or None. Read for
    # a backend named by the caller (then it raises) and by "auto" and the self-check (then skip).
    unsupported: Callable[[Facts], str | None] | None = None
    # Auto only: why it is not trusted for the call here (its self-check or first-use check
    # failed; the verifier logs that itself), or None once it passed.
    verify: Callable[[Facts], str | None] | None = None
    # The device types "auto" and the self-check run it on (None: any). Named by the caller it
    # runs wherever ``unsupported`` allows (Triton's CPU interpreter, in the tests).
    auto_devices: tuple[str, ...] | None = None
    # Auto only: why "auto" does not prefer it for a call it takes (a size from which another
    # backend is the faster), or None; read before the verifier, which then does not run.
    auto_limit: Callable[[Facts], str | None] | None = None
    # What the refusal says it cannot run, before the reason (fla: the fla-core kind).
    subject: Callable[[Facts], str | None] | None = None

    def refusal(self, facts: Facts) -> str | None:
        """Why this backend, named by the caller, cannot take the call, or None."""
        return None if self.unsupported is None else self.unsupported(facts)

    def off_device(self, facts: Facts) -> str | None:
        """Why "auto" and the self-check do not run it on the call's device, or None."""
        if self.auto_devices is None or facts.device.type in self.auto_devices:
            return None
        kinds = " and ".join(kind.upper() if kind == "cuda" else kind for kind in self.auto_devices)
        return f"it runs on {kinds} devices here, not {facts.device.type!r}"

    def declines(self, facts: Facts) -> str | None:
        """Why "auto" and the self-check do not run it for the call (before its verifier)."""
        return self.off_device(facts) or self.refusal(facts)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    backends: dict[str, Backend]    # in the order errors and the doctor list them
    auto: tuple[str, ...]           # "auto"'s preference; its last backend takes every call
    facts: Callable[..., Facts]     # the op's call arguments -> Facts

    def __post_init__(self):
        unknown = [name for name in self.auto if name not in self.backends]
        if unknown or not self.auto:
            raise ValueError(f"{self.name}: auto prefers {list(self.auto)}, not all of its "
                             f"backends {list(self.backends)}")

    def backend(self, name: str) -> Backend:
        if name not in self.backends:
            known = ", ".join(repr(known) for known in [AUTO, *self.backends])
            raise ValueError(f"{self.name}: unknown backend {name!r}; known backends: {known}")
        return self.backends[name]


_OPS: dict[str, Op] = {}
_LOGGED: set[tuple] = set()
_OVERRIDES: dict[str, str] = {}  # op -> the backend its "auto" calls run on


def declare(op: Op) -> Op:
    """Register ``op`` (its package does, on import); a second declaration replaces the first."""
    _OPS[op.name] = op
    return op


def get(name: str) -> Op:
    if name not in _OPS:
        raise ValueError(f"no op {name!r} is declared; declared: {', '.join(_OPS)}")
    return _OPS[name]


def ops() -> dict[str, Op]:
    """The declared ops, by name (those whose packages have been imported)."""
    return dict(_OPS)


def override(backends: dict[str, str]) -> None:
    """Run each op named in ``backends`` on the backend named for it wherever a call asks for
    "auto" (calls that name a backend keep theirs); replaces the previous table, ``{}`` clears
    it. ValueError, before anything changes, for an op not declared or a backend it lacks."""
    for op, backend in backends.items():
        get(op).backend(backend)
    _OVERRIDES.clear()
    _OVERRIDES.update(backends)


def named(op: str, requested: str = AUTO) -> str:
    """What a call of ``op`` asking for ``requested`` names: the op's backend in the override
    table for "auto" (:func:`override`), else ``requested`` ("auto" included). ValueError if
    the op has no backend of that name."""
    if requested == AUTO:
        return _OVERRIDES.get(op, AUTO)
    get(op).backend(requested)
    return requested


def choose(op: str, requested: str = AUTO, facts: Facts | None = None, **fields) -> str:
    """The backend that runs ``op`` for a call with these facts (a :class:`Facts`, or its
    fields as keywords). ``requested``: a backend's name (ValueError if the op has none of that
    name, :class:`BackendUnavailable` if it cannot take the call) or "auto": the op's backend in
    the override table (:func:`override`) if it has one, taken as if named, else the module
    docstring's choice."""
    spec = get(op)
    requested = named(op, requested)
    facts = Facts(**fields) if facts is None else facts
    if not isinstance(facts.device, torch.device):
        facts = dataclasses.replace(facts, device=torch.device(facts.device))
    if requested != AUTO:
        backend = spec.backend(requested)
        reason = backend.refusal(facts)
        if reason is not None:
            raise BackendUnavailable(_refusal_message(spec, backend, facts, reason))
        return requested
    passed_over = []  # (name, why not, whether it runs on the device but not these inputs)
    for name in spec.auto:
        backend = spec.backends[name]
        reason, inputs = backend.off_device(facts), False
        if reason is None:
            reason = backend.refusal(facts)
            inputs = reason is not None
        if reason is None and backend.auto_limit is not None:
            reason = backend.auto_limit(facts)
        if reason is None and backend.verify is not None:
            reason = backend.verify(facts)
        if reason is None or name == spec.auto[-1]:
            _log_choice(spec, facts, name, passed_over)
            return name
        passed_over.append((name, reason, inputs))
    raise AssertionError("unreachable: the last preference is returned")


def _refusal_message(op: Op, backend: Backend, facts: Facts, reason: str) -> str:
    subject = None if backend.subject is None else backend.subject(facts)
    what = reason if subject is None else f"{subject}: {reason}"
    return f"{op.name}: backend '{backend.name}' cannot run {what}"


def _log_choice(op: Op, facts: Facts, name: str, passed_over) -> None:
    """Say once per (op, device, dtype, choice) what "auto" runs, and why not what it prefers:
    a warning where a preferred backend runs on the device but does not take these inputs (a
    slower path runs; a failed verifier has warned already), else at info level."""
    key = (op.name, str(facts.device), facts.dtype, name)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    dtype = "any dtype" if facts.dtype is None else str(facts.dtype).removeprefix("torch.")
    why = "; ".join(f"not {other!r}: {reason}" for other, reason, _ in passed_over)
    slower = any(inputs for _, _, inputs in passed_over)
    (logger.warning if slower else logger.info)(
        "megatron-ext: backend='auto' runs %s as %r on %s in %s%s", op.name, name, facts.device,
        dtype, f" ({why})" if why else "")


def call(op: str, backend: str, *args, **kwargs):
    """Run ``op`` on its arguments with the backend :func:`choose` picks for them."""
    spec = get(op)
    name = choose(op, backend, spec.facts(*args, **kwargs))
    return spec.backends[name].function(*args, **kwargs)


def require(op: str, backend: str, *args, **kwargs) -> None:
    """Raise :class:`BackendUnavailable` where ``backend`` of ``op`` cannot take a call with
    these arguments (for the backends' functions, public on their own)."""
    spec = get(op)
    chosen = spec.backend(backend)
    facts = spec.facts(*args, **kwargs)
    reason = chosen.refusal(facts)
    if reason is not None:
        raise BackendUnavailable(_refusal_message(spec, chosen, facts, reason))
