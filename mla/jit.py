"""JIT: each kernel variant is compiled once per process (memory cache) and once per machine (TileLang's disk
cache, ``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``). One log line per variant built, with its time: TileLang's
own "begins / completes to compile" INFO lines are held back during our builds, and so is one known, harmless
compiler warning (``KNOWN_WARNINGS``); every other line the compiler prints still reaches stderr."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import tempfile
import time

from mla.target import TargetSpec
from tl_kernels.mla_amax import AmaxKernelConfig, mla_amax_kernel
from tl_kernels.mla_combine import CombineKernelConfig, mla_combine_kernel
from tl_kernels.mla_decode import DecodeKernelConfig, mla_decode_kernel
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig, mla_decode_ws_kernel
from tl_kernels.mla_decode_rows import RowsDecodeKernelConfig, mla_decode_rows_kernel
from tl_kernels.mla_schedule import SplitScheduleConfig, mla_split_schedule_kernel

log = logging.getLogger("mla")

# Compiler warnings that say nothing the user can act on, dropped from a build's stderr (substring match):
#   - tl_kernels/mla_decode.py, the mxfp4 dequantization into shared memory (the two T.Parallel loops over the
#     latent and rope dims that call mxfp4_element): TileLang plans a 2-wide vector over d (the two nibbles of one
#     byte) and cannot legalize it (the nibble shift depends on d % 2), so each loop runs element by element, as it
#     is written. Printed once per loop, i.e. twice per mxfp4 variant; the values are exact either way.
KNOWN_WARNINGS = ("T.vectorized loop over `vec` with extent 2 is lowered as a serial loop",)


def prim_func(cfg: DecodeKernelConfig | WSDecodeKernelConfig | CombineKernelConfig):
    """The TileLang prim_func of a kernel config."""
    if isinstance(cfg, DecodeKernelConfig):
        return mla_decode_kernel(cfg)
    if isinstance(cfg, WSDecodeKernelConfig):
        return mla_decode_ws_kernel(cfg)
    if isinstance(cfg, RowsDecodeKernelConfig):
        return mla_decode_rows_kernel(cfg)
    if isinstance(cfg, CombineKernelConfig):
        return mla_combine_kernel(cfg)
    if isinstance(cfg, SplitScheduleConfig):
        return mla_split_schedule_kernel(cfg)
    if isinstance(cfg, AmaxKernelConfig):
        return mla_amax_kernel(cfg)
    raise TypeError(f"not a kernel config: {type(cfg).__name__}")


@functools.lru_cache(maxsize=None)
def get_kernel(cfg: DecodeKernelConfig | CombineKernelConfig, spec: TargetSpec):
    """The compiled kernel for ``cfg`` on ``spec`` (compiled on first use, then cached)."""
    import tilelang  # deferred: importing TileLang costs ~1 s and is only needed to build kernels

    start = time.perf_counter()
    with _quiet_build():
        kernel = tilelang.compile(prim_func(cfg), target=spec.target_dict)
    log.info("mla: %s for %s ready in %.1f s", cfg.name, spec.name, time.perf_counter() - start)
    return kernel


@contextlib.contextmanager
def _quiet_build():
    """During one build: TileLang's INFO lines held back (its logger at WARNING), and the compiler's stderr (C++
    logging writes to file descriptor 2) passed through a file, then written back without ``KNOWN_WARNINGS``."""
    tl_log = logging.getLogger("tilelang.jit.kernel")
    level = tl_log.level
    tl_log.setLevel(max(level, logging.WARNING))
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (embedded interpreters): nothing to filter
        saved = None
    try:
        if saved is None:
            yield
            return
        with tempfile.TemporaryFile(mode="w+b") as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                text = captured.read().decode(errors="replace")
                kept = [line for line in text.splitlines(keepends=True)
                        if not any(w in line for w in KNOWN_WARNINGS)]
                if kept:
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()
    finally:
        tl_log.setLevel(level)


@functools.lru_cache(maxsize=None)
def get_launcher(cfg: DecodeKernelConfig | CombineKernelConfig, spec: TargetSpec):
    """The cheapest callable that launches ``cfg`` with all arguments given positionally (outputs included).

    With TileLang's tvm-ffi backend this is the executable's entry function itself (a ``tvm_ffi.Function``),
    skipping the adapter's per-call Python bookkeeping (it allocates nothing for us: every output is passed in) and
    the executable's own ``__call__`` (which looks its module and entry function up on every call)."""
    kernel = get_kernel(cfg, spec)
    executable = getattr(getattr(kernel, "adapter", None), "get_exportable_executable", None)
    if executable is None:
        return kernel
    executable = executable()
    # A fresh compile gives a tvm.runtime.Executable (its module comes from .jit()), a disk-cache hit the module.
    module = executable.jit() if hasattr(type(executable), "jit") else executable
    entry = getattr(module, "main", None)
    return entry if callable(entry) else executable


@functools.lru_cache(maxsize=None)
def lower(cfg: DecodeKernelConfig | CombineKernelConfig, spec: TargetSpec):
    """Lower (no device compiler) for ``spec``; returns TileLang's artifact with ``.kernel_source``. Cached per
    process, so the tests that read one variant's lowered code (tests/test_gfx942.py, tests/test_golden.py) lower
    it once.

    Works for any target on a CPU-only machine, e.g. gfx942 without ROCm."""
    import tilelang
    from tvm import target as tvm_target

    with tvm_target.Target(spec.target_dict):
        return tilelang.lower(prim_func(cfg), target=spec.target_dict)


def lowered_lds_bytes(artifact) -> int:
    """Dynamic shared memory (LDS) in bytes that a lowered kernel needs, as the compiler computed it: the
    ``dyn_shared_memory_buf`` attribute of the artifact's device function(s) (the largest, if there are several;
    0 when the kernel uses none). Lowering does not check it against the target's limit: callers must."""
    sizes = [0]
    for func in artifact.device_mod.functions.values():
        attrs = func.attrs
        if attrs is not None and "dyn_shared_memory_buf" in attrs:
            sizes.append(int(attrs["dyn_shared_memory_buf"]))
    return max(sizes)
