"""The rules of the linear-recurrence ops' fast backends, which their declarations in the
backend registry (``registry.py``; ``delta_rule/__init__.py``, ``decay/__init__.py`` and
``dplr/__init__.py``) use: what our Triton kernels take (:func:`triton_unsupported`,
:func:`decay_triton_unsupported`), the self-check that verifies them (:func:`triton_verified`,
:func:`triton_verdict`), and when fla-core may run (:func:`fla_unavailable_reason`,
:func:`fla_unsupported`).

"auto" (``registry.choose``) runs our Triton kernels ("triton") on CUDA for the calls they take,
once they have passed the self-check on this GPU for the call's form and dtype; otherwise the
chunked PyTorch form, with the reason logged once.

fla-core is never chosen by "auto": on Hopper with Triton 3.4-3.7.0 (torch 2.8-2.11's Triton) it
refuses the backward of its gated kernels, and where it runs, our Triton kernels cover the same
cases. It serves a call asked for by name (``backend="fla"``), where
:func:`fla_unavailable_reason` allows it.

The self-check (``megatron_ext.kernels.selfcheck``) runs the Triton backend of an op against
the fp32 reference, forward and backward, on the cases the doctor checks (grouped heads, an
initial state, T = 97 across a chunk border, packed sequences), each in fp32 and bf16: one job
per (case, dtype). "auto" asks only for the jobs a call relies on (:func:`selfcheck_jobs`: the
case of its input form in its dtype, and the packed case if it packs sequences), so a training
run checks one or two jobs, not all ten of an op. Each job's verdict is kept per process and on
disk, per (GPU, compute capability, torch, Triton, megatron-ext version and a hash of the
kernels' and the check's source), in ``$MEGATRON_EXT_CACHE_DIR/selfcheck.json`` (default
``~/.cache/megatron-ext``), so each machine image pays for it once. Most of a job's time is
Triton compiling its kernels, so jobs run in parallel child processes; and one process at a time
checks (a lock next to the cache file): the other ranks of a node wait for its verdicts instead
of compiling the same kernels alongside it. On a 2 x H200 host, the ten jobs of
gated_delta_rule, eight at a time beside other compiling jobs, took over 200 s. A backend that
fails a job is not used for calls that rely on it, and never silently: the failure is logged.
``megatron-ext doctor`` shows every check in full.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import torch

from .cases import CASES, DTYPES

__all__ = [
    "FLA_KINDS", "decay_triton_declined_reason", "decay_triton_unsupported", "fla_unavailable_reason",
    "fla_unsupported", "selfcheck_cache_path", "triton_dims_reason", "triton_unavailable_reason",
    "triton_unsupported", "triton_verdict", "triton_verified",
]

logger = logging.getLogger("megatron_ext.kernels")

# ------------------------------------------------------------------------------------ fla-core
MIN_FLA_VERSION = (0, 6, 0)

# What fla_unavailable_reason knows, by kind: the fla-core 0.6 function (and case) it stands for.
FLA_KINDS = {
    "deltanet": "chunk_delta_rule",
    "gdn": "chunk_gated_delta_rule",
    "kda": "chunk_kda",
    "gdn2": "chunk_gdn2",
    "linear": "chunk_simple_gla without a decay (causal linear attention)",
    "simple_gla": "chunk_simple_gla with a per-token decay g [B, T, H] (Mamba-2 SSD)",
    "simple_gla_gamma": "chunk_simple_gla with a constant decay g_gamma [H] (RetNet, Lightning)",
    "gla": "chunk_gla",
    "attn": "parallel_attn (softmax attention with a window and a sink; benchmarks only)",
}

# fla-core 0.6.0 refuses the backward of these on Hopper with 3.4.0 <= Triton < 3.7.1: their
# backward runs fla.ops.common.chunk_o.chunk_bwd_dqkwg with a decay g, which raises "Triton >=
# 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg (see
# #640)". chunk_delta_rule and simple_gla without a decay or with g_gamma only pass g=None, and
# chunk_kda, chunk_gdn2 and chunk_gla have backward kernels of their own.
HOPPER_BAD_TRITON = ((3, 4, 0), (3, 7, 1))
REFUSED_BACKWARD_ON_HOPPER = {"gdn", "simple_gla"}


def _version(text: str) -> tuple[int, int, int]:
    """``"3.6.0"``, ``"3.7.1+git1234"``, ``"0.6.0rc1"`` -> (major, minor, patch)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part or 0) for part in match.groups())


def fla_unavailable_reason(kind: str, device, requires_grad: bool) -> str | None:
    """Why fla-core must not run ``kind`` (a key of FLA_KINDS) on ``device``, or None if it may.

    The rules, in order: fla-core is importable; its version is at least 0.6.0; the device is a
    CUDA device (fla's kernels are Triton GPU kernels); and the call is not a known-bad
    combination. The one known today: on Hopper (compute capability 9.x) with Triton >= 3.4.0
    and < 3.7.1, fla-core refuses the backward of its gated chunk kernels, so "gdn" and
    "simple_gla" are refused there when ``requires_grad``; their forward, and every other kind,
    run.
    """
    if kind not in FLA_KINDS:
        known = ", ".join(repr(name) for name in FLA_KINDS)
        raise ValueError(f"fla_unavailable_reason: unknown kind {kind!r}; known kinds: {known}")
    try:
        import fla
    except ImportError as error:
        return f"fla-core is not installed ({error}); install fla-core>=0.6.0"
    version = getattr(fla, "__version__", "0")
    if _version(version) < MIN_FLA_VERSION:
        return f"fla-core {version} is installed; the adapter needs fla-core>=0.6.0"
    device = torch.device(device)
    if device.type != "cuda":
        return f"fla-core's kernels are Triton GPU kernels and need a CUDA device, not {device.type!r}"
    if requires_grad and kind in REFUSED_BACKWARD_ON_HOPPER:
        import triton

        capability = torch.cuda.get_device_capability(device)
        low, high = HOPPER_BAD_TRITON
        if capability[0] == 9 and low <= _version(triton.__version__) < high:
            return (
                f"fla-core {version} refuses the backward of {FLA_KINDS[kind]} on Hopper "
                f"(compute capability {capability[0]}.{capability[1]}) with Triton "
                f"{triton.__version__}: Triton >= 3.4.0 and < 3.7.1 gives wrong gradients in its "
                "gated chunk_bwd_dqkwg (fla-core issue #640). Forward-only calls are fine; "
                "KDA, GDN-2 and DeltaNet are unaffected; Triton >= 3.7.1 fixes it"
            )
    return None


def fla_unsupported(kind_of_form: dict[str, str]):
    """The registry's ``unsupported`` rule of an op's fla backend: :func:`fla_unavailable_reason`
    for the fla-core kind of the call's input form (``kind_of_form``). An unknown form is left to
    the backend, which names what is wrong with its inputs."""

    def unsupported(facts) -> str | None:
        kind = kind_of_form.get(facts.form)
        return None if kind is None else fla_unavailable_reason(kind, facts.device, facts.requires_grad)

    return unsupported


# ------------------------------------------------------------------- our Triton kernels' rules
# The head dims (K and V) our Triton kernels take: tl.dot wants power-of-two tiles of 16 or more.
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
# The dtypes of q, k and v they take (their tl.dot operands).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dims_reason(key_dim: int, value_dim: int) -> str | None:
    if key_dim in TRITON_HEAD_DIMS and value_dim in TRITON_HEAD_DIMS:
        return None
    return (f"K = {key_dim}, V = {value_dim}: the Triton kernels take head dims "
            f"{', '.join(map(str, TRITON_HEAD_DIMS))}")


def triton_dims_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why our Triton kernels do not take these head dims (K = q's last, V = v's), or None.
    ``backend="auto"`` then runs chunked; ``backend="triton"`` raises."""
    return _dims_reason(q.shape[-1], v.shape[-1])


def triton_runs_on(device) -> bool:
    """Whether our Triton kernels can take tensors on ``device``: CUDA, or the CPU under Triton's
    interpreter (TRITON_INTERPRET=1)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def triton_unavailable_reason(device, dtype: torch.dtype | None) -> str | None:
    """Why our Triton kernels cannot run on ``device`` for q/k/v in ``dtype`` (None: any), or
    None if they can: they need a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1, with
    CPU tensors) and fp32, bf16 or fp16 inputs."""
    device = torch.device(device)
    if not triton_runs_on(device):
        return (f"tensors on {device.type}: its Triton kernels need a CUDA device, not "
                f"{device.type!r} (or Triton's CPU interpreter, TRITON_INTERPRET=1)")
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"inputs in {dtype} (float32, bfloat16 and float16 only)"
    return None


def _decay_declined(device: torch.device, dtype, key_dim: int, form: str | None) -> str | None:
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and key_dim < 64
            and form != "per_channel"):
        return (f"K = {key_dim} in {dtype} with {'no' if form == 'none' else 'a scalar'} decay on a "
                f"GPU (K >= 64 there: at K = 32 the backward was wrong on an H200)")
    return None


def decay_triton_declined_reason(q: torch.Tensor, g: torch.Tensor | None) -> str | None:
    """Why our decay Triton kernels decline these inputs, or None: on CUDA tensor cores (bf16 or
    fp16 q), a key dim below 64 with no decay or a scalar one. On an H200 (Triton 3.6.0) their
    backward gave dk 0.7 to 0.9 off (relative) at K = 32 in these forms, while K = 64 and 128 and
    the per-channel form at K = 32 passed (tests/ops/test_triton_decay.py). ``backend="auto"``
    then runs chunked; ``backend="triton"`` refuses."""
    form = "none" if g is None else "per_channel" if g.dim() == 4 else "scalar"
    return _decay_declined(q.device, q.dtype, q.shape[-1], form)


def _delta_declined(device: torch.device, dtype, value_dim: int | None, form: str | None) -> str | None:
    """Why the delta-rule kernels decline a per-channel decay (KDA, GDN-2) below V = 128 on a GPU
    in 16 bits, or None. On an H100 (Triton 3.6.0) their bf16 gradients of q, k, beta and g came
    back NaN at K = V = 64 (tests/ops/test_triton_delta_rule.py::test_hybrid_preset_heads[kda-bf16],
    followed by an illegal memory access), while K = 64, V = 128 and K = V = 128 pass there; under
    the interpreter the same case is right (a code generation failure, as in "Hopper" of
    delta_rule/triton.py). V = 16 and 32 have not run on a GPU in this form."""
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and form in ("kda", "gdn2")
            and value_dim is not None and value_dim < 128):
        return (f"a per-channel decay at V = {value_dim} in {dtype} on a GPU (V >= 128 there: at "
                f"K = V = 64 the bf16 gradients were NaN on an H100)")
    return None


def triton_unsupported(facts) -> str | None:
    """The registry's ``unsupported`` rule of our Triton kernels of the gated delta rule: head
    dims, then device and dtype (the promoted dtype of q, k and v), then what the kernels decline
    (:func:`_delta_declined`)."""
    if facts.key_dim is not None and facts.value_dim is not None:
        reason = _dims_reason(facts.key_dim, facts.value_dim)
        if reason is not None:
            return reason
    dtype = facts.compute_dtype or facts.dtype
    return (triton_unavailable_reason(facts.device, dtype)
            or _delta_declined(facts.device, dtype, facts.value_dim, facts.form))


def decay_triton_unsupported(facts) -> str | None:
    """:func:`triton_unsupported`, and then what the decay kernels decline
    (:func:`decay_triton_declined_reason`)."""
    reason = triton_unsupported(facts)
    if reason is None and facts.key_dim is not None and facts.dtype is not None:
        reason = _decay_declined(facts.device, facts.dtype, facts.key_dim, facts.form)
    return reason


# ---------------------------------------------------------------------------- the self-check
# (device key, "op/case/dtype") -> {"passed": bool, "reason": str}
_VERDICTS: dict[tuple[str, str], dict] = {}


def selfcheck_cache_path() -> pathlib.Path:
    root = os.environ.get("MEGATRON_EXT_CACHE_DIR") or pathlib.Path.home() / ".cache" / "megatron-ext"
    return pathlib.Path(root) / "selfcheck.json"


def _kernels_fingerprint() -> str:
    """The package version and a hash of the Triton kernels' source, so that an edited kernel
    (an editable install keeps its version) or a tree that is not installed is checked anew."""
    import hashlib
    import importlib.metadata

    try:
        version = importlib.metadata.version("megatron-ext")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    here = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for source in ("chunks.py", "delta_rule/triton.py", "decay/triton.py", "dplr/triton.py",
                   "dplr/chunked.py", "selfcheck.py", "cases.py"):
        digest.update((here / source).read_bytes())
    return f"{version}, kernels {digest.hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def _device_key(device: torch.device) -> str:
    """What a verdict depends on: the GPU, its compute capability and the software versions
    (computed once per device: the registry's choice asks in every layer's forward)."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)} sm_{major}{minor} | torch {torch.__version__} | "
            f"triton {triton.__version__} | megatron-ext {_kernels_fingerprint()}")


def _read_cache(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: pathlib.Path, key: str, verdicts: dict) -> None:
    """Add verdicts (by job key, "op/case/dtype"), atomically (ranks of one node may write at
    the same time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache(path)
        cache.setdefault(key, {}).update(verdicts)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(cache, f, indent=1)
        os.replace(f.name, path)
    except OSError as error:  # a read-only home: the verdict still holds for this process
        logger.warning("megatron-ext: cannot write the self-check cache %s (%s)", path, error)


SELFCHECK_TIMEOUT_S = 900
SELFCHECK_WORKERS = 8  # child processes at a time, at most one per CPU core


@functools.lru_cache(maxsize=None)
def selfcheck_jobs(op: str, form: str | None = None, dtype: torch.dtype | None = None,
                   packed: bool = False) -> tuple[tuple[str, str], ...]:
    """The self-check jobs ``(case, dtype name)`` of ``op`` that a call relies on: the cases of
    its input ``form`` (cases.py's DELTA_RULE_CASES / DECAY_CASES; for some forms also one
    long enough for segmented state walks) in its dtype, plus the op's packed case(s) in that
    dtype when the call packs sequences (cu_seqlens). fp16 calls rely on
    the bf16 check (the same 16-bit tensor-core code). ``form=None``: every job of the op."""
    cases = CASES[op]
    if form is None:
        return tuple((case.name, _dtype_name(d)) for case in cases for d in DTYPES)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    return tuple((case.name, name) for case in cases
                 if (case.form == form and not case.packed) or (packed and case.packed))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run_selfcheck(op: str, device: torch.device, jobs) -> dict:
    """Run the Triton checks ``jobs`` (``(case, dtype)`` pairs) of ``op`` in child processes
    (``python -m megatron_ext.kernels.selfcheck OP triton DEVICE CASE DTYPE``), one per job,
    several at a time: each compiles its case's kernels on a core of its own. Children, not this
    process: a kernel that faults (an illegal memory access) leaves its CUDA context unusable,
    and it must be a child's, not the training's. Returns each job's verdict."""

    def check(job):
        command = [sys.executable, "-m", "megatron_ext.kernels.selfcheck", op, "triton", str(device), *job]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SELFCHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return [f"{'/'.join(job)}: the check took over {SELFCHECK_TIMEOUT_S} s"]
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            return [f"{'/'.join(job)}: the check exited with status {done.returncode}: {tail}"]
        return json.loads(lines[-1])["failures"]

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(len(jobs), SELFCHECK_WORKERS, cores or 1))  # the cores this job may use
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        found = list(pool.map(check, jobs))
    return {job: {"passed": False, "reason": "; ".join(failures)} if failures else
            {"passed": True, "reason": "within tolerance, forward and backward"}
            for job, failures in zip(jobs, found)}


@contextlib.contextmanager
def _selfcheck_lock(path: pathlib.Path):
    """Hold an exclusive lock on ``path`` + ".lock" (flock), or nothing where locking is not
    possible (a read-only cache directory, a file system without flock): then processes may
    check side by side, which costs time, not correctness."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "w")
    except OSError:
        yield
        return
    with handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("megatron-ext: waiting for another process's Triton self-check "
                               "(lock %s)", handle.name)
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _job_key(op: str, job) -> str:
    return "/".join((op, *job))


def triton_verdict(op: str, device, jobs=None) -> dict:
    """The self-check verdict of the Triton backend of ``op`` on this CUDA ``device`` for the
    jobs ``jobs`` (:func:`selfcheck_jobs`; None: every job of the op): passed when every one
    passed. Each job's verdict comes from this process's memory, else the disk cache, else from
    running the check (and caching it); one process of a machine at a time runs checks, the
    others then read their verdicts. So a training run checks only the forms and dtype it
    uses: one or two child processes, not every case of the op."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        key = _device_key(device)
    except ImportError as error:
        return {"passed": False, "reason": f"Triton does not import ({error})"}
    jobs = selfcheck_jobs(op) if jobs is None else tuple(jobs)
    new = [job for job in jobs if (key, _job_key(op, job)) not in _VERDICTS]
    if new:
        path = selfcheck_cache_path()
        _VERDICTS.update(_cached(path, key, op, new))
        if any((key, _job_key(op, job)) not in _VERDICTS for job in new):
            with _selfcheck_lock(path):
                _VERDICTS.update(_cached(path, key, op, new))  # another process's, meanwhile
                _check_and_cache(op, device, key, path,
                                 [job for job in new if (key, _job_key(op, job)) not in _VERDICTS])
        for job in new:  # a failure is logged once per process, whoever ran the check
            verdict = _VERDICTS[(key, _job_key(op, job))]
            if not verdict["passed"]:
                logger.warning("megatron-ext: the Triton kernels of %s failed their self-check "
                               "(%s) on %s and are not used for such calls (backend='auto' runs "
                               "the chunked PyTorch form): %s", op, "/".join(job), key,
                               verdict["reason"])
    failed = [_VERDICTS[(key, _job_key(op, job))]["reason"] for job in jobs
              if not _VERDICTS[(key, _job_key(op, job))]["passed"]]
    if failed:
        return {"passed": False, "reason": "; ".join(failed)}
    return {"passed": True, "reason": "every checked case within tolerance, forward and backward"}


def _check_and_cache(op: str, device: torch.device, key: str, path: pathlib.Path, jobs) -> None:
    """Run the checks ``jobs`` of ``op``, keep their verdicts in _VERDICTS and on disk."""
    if not jobs:
        return
    names = ", ".join("/".join(job) for job in jobs)
    logger.warning("megatron-ext: checking the Triton kernels of %s (%s) on %s against the "
                   "reference (once per machine; cached in %s)", op, names, key, path)
    start = time.perf_counter()
    verdicts = _run_selfcheck(op, device, jobs)
    logger.warning("megatron-ext: the self-check of %s (%s) took %.0f s", op, names,
                   time.perf_counter() - start)
    _write_cache(path, key, {_job_key(op, job): verdict for job, verdict in verdicts.items()})
    _VERDICTS.update({(key, _job_key(op, job)): verdict for job, verdict in verdicts.items()})


def _cached(path: pathlib.Path, key: str, op: str, jobs) -> dict:
    """The verdicts of ``jobs`` the disk cache holds, as _VERDICTS entries."""
    on_disk = _read_cache(path).get(key, {})
    return {(key, _job_key(op, job)): on_disk[_job_key(op, job)] for job in jobs
            if _job_key(op, job) in on_disk}


def triton_verified(op: str):
    """The registry's verifier of the Triton backend of ``op``: the self-check's verdict on a
    CUDA device for the jobs the call relies on (its input form and dtype, and the packed case
    if it packs sequences; :func:`selfcheck_jobs`), None once they passed, else why not."""

    def verify(facts) -> str | None:
        if facts.device.type != "cuda":
            return f"its self-check runs on CUDA devices, not {facts.device.type!r}"
        jobs = selfcheck_jobs(op, facts.form, facts.dtype, packed=facts.packed)
        verdict = triton_verdict(op, facts.device, jobs)
        return None if verdict["passed"] else f"failed its self-check: {verdict['reason']}"

    return verify
