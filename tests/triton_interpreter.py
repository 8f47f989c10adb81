"""Test support for running our Triton kernels on Triton's CPU interpreter (as tests/harness.py
is for megatron-core on a CPU).

The interpreter is chosen when a kernel is defined (TRITON_INTERPRET=1 must be set before the
kernel's module is imported). So each tests/ops/test_triton_interpret_*.py runs itself as a
script in a subprocess with TRITON_INTERPRET=1 (:func:`run_as_script`, its pytest test); the
script calls :func:`setup` (one CPU thread, the numpy fix, the bounds checker) and runs the
checks of its GPU test module, loaded by :func:`gpu_checks`, with :func:`run_cases` and
:func:`run_ops`.

The interpreter runs on one CPU thread, so a script whose work is a list of cases runs as
several processes at once, one per CPU (at most :data:`MAX_SHARDS`): each takes every n-th of
the cases and steps it is dealt (:func:`share`, :func:`takes_next`; ``run_as_script(path,
sharded=True)``).
"""
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
TESTS = pathlib.Path(__file__).resolve().parent
OPS_TESTS = TESTS / "ops"  # the kernels' tests: the GPU modules whose checks the scripts run


SHARD = "MEGATRON_EXT_INTERPRETER_SHARD"  # "i/n": this process takes share i of n
MAX_SHARDS = 4  # processes at once (each imports its own torch and Triton)


def shard_count() -> int:
    """How many processes a sharded script runs as: one per CPU this process may use, at most
    :data:`MAX_SHARDS`."""
    return max(1, min(MAX_SHARDS, len(os.sched_getaffinity(0))))


def run_sharded(command: list[str], environment: dict, shards: int, timeout: float = 600) -> list[str]:
    """Run ``command`` as ``shards`` processes at once, share i of n named in each one's
    environment (:data:`SHARD`); assert that each exits 0 (its output, shortened, is the failure
    message otherwise) and return their stdouts, in share order."""
    processes = [subprocess.Popen(command, env=dict(environment, **{SHARD: f"{i}/{shards}"}), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(shards)]
    outputs = []
    try:
        for i, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=timeout)
            assert process.returncode == 0, f"share {i} of {shards}: " + (stdout + stderr)[-6000:]
            outputs.append(stdout)
    finally:
        for process in processes:
            process.kill()
    return outputs


def run_as_script(path: str, sharded: bool = False) -> None:
    """Run the test file ``path`` as a script under the interpreter (as :func:`shard_count`
    processes if ``sharded``, each running its share of the cases); each must print "interpreter
    cases passed" and exit 0 (its output, shortened, is the failure message otherwise)."""
    # The script imports this module (and harness) from tests/, and its neighbours from its own
    # folder, which safe-path mode leaves off sys.path (scripts/env.sh sets it for python -m from
    # the repository root).
    python_path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    environment = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path)
    environment.pop("PYTHONSAFEPATH", None)
    outputs = run_sharded([sys.executable, path], environment, shard_count() if sharded else 1)
    for i, output in enumerate(outputs):
        assert "interpreter cases passed" in output, f"share {i}: " + output[-6000:]


def _shard() -> tuple[int, int]:
    """(i, n): this process takes share i of n (0 of 1 unless run by :func:`run_sharded`)."""
    index, count = os.environ.get(SHARD, "0/1").split("/")
    return int(index), int(count)


_dealt = 0  # items dealt out by share() in this process so far


def share(items) -> list:
    """This process's share of ``items`` (all of them unless it runs as one of several shares,
    :data:`SHARD`): every n-th item, dealt on from the items of earlier calls, so that lists of
    a few cases each also spread over the shares."""
    global _dealt
    index, count = _shard()
    items = list(items)
    mine = [item for number, item in enumerate(items, _dealt) if number % count == index]
    _dealt += len(items)
    return mine


def report_passed(count: int) -> None:
    """Print the line :func:`run_as_script` looks for, naming the share in a sharded script."""
    index, shards = _shard()
    print(f"all {count} interpreter cases passed" if shards == 1 else
          f"share {index + 1} of {shards} of the {count} interpreter cases passed")


def takes_next() -> bool:
    """Whether this process takes the next step of a sharded script (one item of :func:`share`)."""
    return bool(share([None]))


def setup() -> None:
    """In the script: check that the interpreter is on, use one CPU thread, and patch the
    interpreter (:func:`_fix_for_numpy_2_4`, :func:`_check_bounds`)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    _fix_for_numpy_2_4()
    _check_bounds()


def gpu_checks(name: str):
    """The GPU test module ``tests/ops/<name>.py`` (its checks take a device), imported with
    tests/ops on sys.path, as pytest imports it there."""
    if str(OPS_TESTS) not in sys.path:
        sys.path.insert(0, str(OPS_TESTS))
    return importlib.import_module(name)


def run_cases(cases, check) -> None:
    """``check(case, "cpu")`` for each case, printing the largest of the differences it returns
    (a dict: what -> difference); in a sharded script, this process's share of them."""
    for case in share(cases):
        start = time.perf_counter()
        errors = check(case, "cpu")
        worst = max(errors, key=errors.get)
        print(f"{case}: ok, worst {worst} {errors[worst]:.1e} ({time.perf_counter() - start:.1f} s)",
              flush=True)


def run_ops(checks, what: str) -> None:
    """``checks.check_ops("cpu")`` (the ops of kernels.residual.efficient with their Triton
    kernels running CPU tensors, here under the interpreter), printing its launch count; in a
    sharded script, by the process whose step it is."""
    if not takes_next():
        return
    from megatron_ext.kernels.residual import efficient

    start = time.perf_counter()
    with auto_on_cpu(*efficient.OPS):
        launches = checks.check_ops("cpu")
    print(f"{what}: ok, {launches} kernel launches ({time.perf_counter() - start:.1f} s)", flush=True)


def widen_bf16_dots() -> None:
    """Triton 3.6's interpreter keeps bf16 as raw 16-bit integers (NumPy has no bf16) and its
    tl.dot multiplies those integers. Call this in a script whose kernels take bf16 dots: it
    widens bf16 dot operands to fp32 first, exactly (as tensor cores do, accumulating in fp32).
    (The interpreter also truncates fp32 to bf16 where a GPU rounds to nearest; that stays.)"""
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def dot_of_bf16(self, a, b, d, *args):
        return dot(self, widen(a), widen(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = dot_of_bf16


def _fix_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int() of a 1-element
    array, which numpy >= 2.4 refuses, so a loop over a runtime number of chunks fails there
    (triton-lang/triton issue #9171, closed upstream). Take the element explicitly;
    the same value as before, for the interpreter only."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index


def _check_bounds() -> None:
    """Fail any load, store or atomic update of a kernel that leaves the tensors passed to its
    launch. The
    interpreter reads and writes host memory directly, so an access past a tensor's end, which
    faults on a GPU (an illegal memory access) or corrupts a neighbouring buffer, would otherwise
    pass unnoticed. Lanes masked off are not checked: they access nothing on a GPU either. A
    tensor's extent runs from its first to its last element, so strided views count too."""
    from triton.runtime import interpreter

    launch = {"kernel": None, "extents": []}  # the running kernel's tensors: (first byte, end)
    run_grid = interpreter.GridExecutor.__call__
    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def extent(tensor):
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        end = tensor.data_ptr() + (last + 1) * tensor.element_size() if tensor.numel() else tensor.data_ptr()
        return tensor.data_ptr(), end

    def run_grid_recording_extents(self, *args, **kwargs):
        tensors = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor)]
        launch.update(kernel=self.fn.__name__, extents=[extent(tensor) for tensor in tensors])
        run_grid(self, *args, **kwargs)

    def check(ptrs, mask, access):
        addresses = ptrs.data[np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)]
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in launch["extents"]:
            inside |= (addresses >= start) & (addresses + size <= end)
        if not inside.all():
            raise IndexError(f"{launch['kernel']}: {access} of {(~inside).sum()} elements outside the tensors of "
                             "the launch")

    def checked_load(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    def checked_atomic(self, op, ptrs, value, mask, *rest):
        check(ptrs, mask, "atomic update")
        return atomic(self, op, ptrs, value, mask, *rest)

    atomic = interpreter.InterpreterBuilder.create_atomic_rmw
    interpreter.GridExecutor.__call__ = run_grid_recording_extents
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store
    interpreter.InterpreterBuilder.create_atomic_rmw = checked_atomic


@contextlib.contextmanager
def auto_on_cpu(*ops: str):
    """While open, "auto" considers the triton backends of these ops of the backend registry
    (kernels.registry) on the CPU too (their kernels under Triton's interpreter)."""
    from megatron_ext.kernels import registry

    declared = [registry.get(op).backends for op in ops]
    kept = [backends["triton"] for backends in declared]
    for backends, backend in zip(declared, kept):
        backends["triton"] = dataclasses.replace(backend, auto_devices=(*backend.auto_devices, "cpu"))
    try:
        yield
    finally:
        for backends, backend in zip(declared, kept):
            backends["triton"] = backend


def triton_on_cpu(monkeypatch, *ops: str) -> None:
    """For the rest of the test, "auto" considers the triton backends of these ops of the
    backend registry on the CPU (:func:`auto_on_cpu` through ``monkeypatch``)."""
    from megatron_ext.kernels import registry

    for op in ops:
        backends = registry.get(op).backends
        backend = backends["triton"]
        monkeypatch.setitem(backends, "triton",
                            dataclasses.replace(backend, auto_devices=(*backend.auto_devices, "cpu")))
