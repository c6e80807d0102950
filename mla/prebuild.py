"""Fill the kernel cache ahead of serving: compile exactly the kernel variants the op's calls will use, in parallel.

Each kernel variant compiles on its first use (2-60 s on a CPU core; the fused one-launch variants about a minute),
so a cold server's first calls would stall for minutes. A deployment that knows its call classes (modes, page size,
head counts, query tokens per sequence, causal) builds them once, ahead of time, here; the op then loads each
from TileLang's disk cache in ~0.1 s. No GPU is needed: a CPU box with the CUDA toolkit (``nvcc``) builds for
sm_90a, and the cache carries to the GPU host::

    python -m mla.prebuild --modes fp8 --page-size 64 --heads 16,128            # every core of this machine
    python -m mla.prebuild --modes bf16,fp8 --page-size 0,64 --heads 16 --q-len 1,2 --causal both --list
    python -m mla.prebuild --modes fp8 --page-size 64 --heads 16 --cache-dir /srv/mla-cache --jobs 8

Which variants: for every (mode, page size, head count, query length, causal) combination, those
``mla.schedule.select_kernels`` may pick whatever the batch size and lengths (``schedule.decode_variants``: the split,
direct and fused-merge decode kernels and the combine kernel; on Hopper's 16-row class the warp-specialised kernel of
``schedule.WS_FORMATS``), and for ``mla.flash_mla`` (paged only) also the one-launch kernels in FlashMLA's argument
shapes (``schedule.flash_io_variant``), which treat ``causal`` as a no-op for one query token, as FlashMLA does.
The opt-in 64-row family (``config_overrides={"rows": True}``) is not built. Variants are deduplicated by name.

Shipping the cache: the build writes to ``TILELANG_CACHE_DIR`` (``--cache-dir`` sets it; default
``~/.tilelang/cache``), under a folder named for the TileLang version. Copy that directory to the serving host and
set ``TILELANG_CACHE_DIR`` to it there; a cached kernel is used only for the same target (``--target``) and the same
TileLang version (``tilelang==0.1.15``, pinned by this package); anything else compiles again on first use.

gfx942: without ROCm (``hipcc``) nothing can be compiled, so ``--target gfx942`` then only lowers each variant with
TileLang (a check that the program is valid for the target) and caches nothing; on a ROCm host it compiles.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import multiprocessing
import os
import shutil
import sys
import time
from typing import Callable, NamedTuple

from mla import schedule
from mla.constants import MODES
from mla.target import TargetSpec, spec_for_name
from mla.validate import SUPPORTED_HEADS, SUPPORTED_PAGE_SIZES
from tl_kernels.mla_combine import CombineKernelConfig
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig
from tl_kernels.mla_schedule import SplitScheduleConfig

TARGETS = ("sm_90a", "gfx942")
PAGE_SIZES = (0, *SUPPORTED_PAGE_SIZES)  # 0: a flat cache
APIS = ("mla_decode", "flash_mla", "both")  # mla_decode covers mla.decode.plan and mla.ops too
CAUSAL = {"off": (False,), "on": (True,), "both": (False, True)}
# What a8w8 calls pass as Q: bf16 (quantized on the device: q_format="fp8"), fp8 codes with their scale
# (q_scale= / FlashMLA's descale_q), or both. Each is its own kernel variant.
A8W8_Q = {"bf16": ("fp8",), "fp8": ("fp8_codes",), "both": ("fp8", "fp8_codes")}


class BuildResult(NamedTuple):
    name: str
    seconds: float
    error: str | None  # None: built (or lowered)


# --- which variants ---------------------------------------------------------------------------------------------


def class_variants(spec: TargetSpec, *, mode: str, num_heads: int, q_tile: int = 1, causal: bool = False,
                   page_size: int = 0, flash_mla: bool = False, q_format: str | None = None,
                   force_ws: bool = False) -> list:
    """The kernels the op may launch for one problem class (``mode``: a key of ``mla.constants.MODES``;
    ``q_format`` overrides its Q precision, e.g. "fp8_codes"): ``schedule.decode_variants``, the warp-specialised
    kernel where the op's default may pick it (``schedule.ws_class_default``; ``force_ws``: wherever
    ``schedule.uses_ws``, as tests that force the family need), and with ``flash_mla`` the FlashMLA-shaped form
    of each (``schedule.flash_io_variant``; None for most) and its graph form (``schedule.graph_config``, the
    combine's flash form and the split schedule: what ``mla.flash_mla`` launches under CUDA-graph capture and for
    metadata made from lengths; CUDA only)."""
    kv_format, mode_q_format = MODES[mode]
    q_format = q_format or mode_q_format
    configs = []
    if force_ws:
        ws = schedule.uses_ws(spec, num_heads=num_heads, q_tile=q_tile)
    else:
        ws = schedule.ws_class_default(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads,
                                       q_tile=q_tile, page_size=page_size)
    if ws:
        configs.append(schedule.ws_default_config(spec, kv_format=kv_format, q_format=q_format,
                                                  num_heads=num_heads, causal=causal, page_size=page_size))
    variants = schedule.decode_variants(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads,
                                        q_tile=q_tile, causal=causal, page_size=page_size)
    configs += variants
    if flash_mla:
        configs += [c for c in map(schedule.flash_io_variant, variants) if c is not None]
        graph = schedule.graph_config(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads,
                                      q_tile=q_tile, causal=causal, page_size=page_size)
        if graph is not None:
            configs += [graph, *schedule.graph_combine_configs(spec, num_heads=num_heads), SplitScheduleConfig()]
    return configs


def unique(configs) -> list:
    """``configs`` without repeats (by ``cfg.name``, which encodes every field that changes the code), in order."""
    by_name = {}
    for cfg in configs:
        by_name.setdefault(cfg.name, cfg)
    return list(by_name.values())


def call_variants(spec: TargetSpec, *, modes, page_sizes, heads, q_lens=(1,), causal=(False,), api: str = "both",
                  a8w8_q: str = "bf16") -> list:
    """Every kernel variant the calls of these classes may use (the product of the options; see the module's
    docstring), unique by name. ``q_lens``: query tokens per sequence (the mean, for ragged batches): 1, 2 and 3+
    each take their own query tile (``schedule.query_tile``)."""
    configs = []
    for mode in modes:
        q_formats = A8W8_Q[a8w8_q] if mode == "a8w8" else (None,)
        for page_size in page_sizes:
            for num_heads in heads:
                for q_tile in dict.fromkeys(schedule.query_tile(q_len, 1) for q_len in q_lens):
                    for is_causal in causal:
                        for q_format in q_formats:
                            problem = dict(mode=mode, num_heads=num_heads, q_tile=q_tile, page_size=page_size,
                                           q_format=q_format)
                            if api in ("mla_decode", "both"):
                                configs += class_variants(spec, causal=is_causal, **problem)
                            if api in ("flash_mla", "both") and page_size:
                                # FlashMLA's rule: causal is a no-op for one query token (mla.flash_mla drops it).
                                configs += class_variants(spec, causal=is_causal and q_tile > 1, flash_mla=True,
                                                          **problem)
    return unique(configs)


# --- building ---------------------------------------------------------------------------------------------------


def _build_one(cfg, spec: TargetSpec, lower_only: bool) -> BuildResult:
    """Worker: compile one variant into TileLang's disk cache (or only lower it)."""
    start = time.perf_counter()
    try:
        from mla import jit

        if lower_only:
            jit.lower(cfg, spec)
        else:
            jit.get_kernel(cfg, spec)
        return BuildResult(cfg.name, time.perf_counter() - start, None)
    except Exception as exc:  # reported by the caller, with every other failure
        return BuildResult(cfg.name, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")


def _build_order(cfg) -> int:
    """Longest first, so the workers finish together: the fused-merge and warp-specialised kernels take about a
    minute each, the other decode kernels 10-40 s, the combine kernel a few seconds."""
    if isinstance(cfg, CombineKernelConfig):
        return 2
    return 0 if isinstance(cfg, WSDecodeKernelConfig) or getattr(cfg, "fused_combine", False) else 1


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build(configs, spec: TargetSpec, *, jobs: int | None = None, lower_only: bool = False,
          log: Callable[[str], None] = print, progress: bool = False, label: str = "mla.prebuild") -> list[BuildResult]:
    """Compile ``configs`` for ``spec`` in ``jobs`` worker processes (default: every core), each into TileLang's disk
    cache (``TILELANG_CACHE_DIR`` as this process's environment has it); ``lower_only``: only lower them. Logs one
    summary line (``progress``: also one line per variant as it finishes) and every failure; returns the results
    in the order of ``configs``. A failure does not stop the others."""
    configs = unique(configs)
    if not configs:
        return []
    jobs = max(1, min(len(configs), jobs or default_jobs()))
    start = time.perf_counter()
    results = {}
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_build_one, cfg, spec, lower_only) for cfg in sorted(configs, key=_build_order)]
        try:
            for future in concurrent.futures.as_completed(futures):
                result = future.result()
                results[result.name] = result
                if progress:
                    state = f"FAILED ({result.error.splitlines()[0]})" if result.error else (
                        "lowered" if lower_only else "ready")
                    log(f"[{len(results)}/{len(configs)}] {result.name}: {state} in {result.seconds:.1f} s")
        except BaseException:  # Ctrl-C: drop what has not started
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    ordered = [results[cfg.name] for cfg in configs]
    failed = [r for r in ordered if r.error]
    log(f"{label}: {len(configs)} kernel variants {'lowered' if lower_only else 'ready'} for {spec.name} in "
        f"{time.perf_counter() - start:.0f} s with {jobs} workers"
        + (f"; {len(failed)} FAILED to build:" if failed else ""))
    for r in failed:
        log(f"  {r.name}: {r.error.splitlines()[0] if r.error else ''}")
    return ordered


def find_device_compiler(spec: TargetSpec) -> str | None:
    """The compiler TileLang needs to build for ``spec`` (nvcc, or hipcc for gfx targets), or None when absent."""
    if spec.is_hip:
        root = os.environ.get("ROCM_PATH") or os.environ.get("ROCM_HOME") or "/opt/rocm"
        candidates = [shutil.which("hipcc"), os.path.join(root, "bin", "hipcc")]
    else:
        root = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidates = [shutil.which("nvcc"), os.path.join(root, "bin", "nvcc")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cache_dir() -> str:
    """Where TileLang's disk cache is (``TILELANG_CACHE_DIR``, as TileLang reads it)."""
    return os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")


# --- command line -----------------------------------------------------------------------------------------------


def _int_list(allowed: tuple | None = None, minimum: int | None = None):
    """argparse type: a comma-separated list of integers, each in ``allowed`` / at least ``minimum`` (argparse's
    error message names the option)."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        for v in values:
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(f"{v} is not one of {', '.join(map(str, allowed))}")
            if minimum is not None and v < minimum:
                raise argparse.ArgumentTypeError(f"{v} is less than {minimum}")
        return tuple(dict.fromkeys(values))

    return parse


def _modes(text: str) -> tuple:
    values = tuple(dict.fromkeys(m.strip() for m in text.split(",")))
    bad = [m for m in values if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode {bad[0]!r}; expected some of {', '.join(MODES)}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mla.prebuild",
        description="Compile, ahead of serving, exactly the kernel variants the op's calls of the given classes "
        "will use, in parallel, into TileLang's disk cache (TILELANG_CACHE_DIR). No GPU needed: sm_90a builds need "
        "the CUDA toolkit (nvcc). Copy the cache directory to the serving host (same target, same TileLang "
        "version) and point TILELANG_CACHE_DIR at it.",
    )
    p.add_argument("--modes", type=_modes, default=tuple(MODES),
                   help=f"comma-separated modes ({', '.join(f'{m}: {kv} KV, {q} Q' for m, (kv, q) in MODES.items())}); "
                   "default: all")
    p.add_argument("--page-size", type=_int_list(PAGE_SIZES), default=(0,),
                   help=f"comma-separated tokens per page, 0 for a flat cache ({', '.join(map(str, PAGE_SIZES))}); "
                   "default 0")
    p.add_argument("--heads", type=_int_list(SUPPORTED_HEADS), default=(16,),
                   help=f"comma-separated query head counts ({', '.join(map(str, SUPPORTED_HEADS))}); default 16")
    p.add_argument("--q-len", type=_int_list(minimum=1), default=(1,),
                   help="comma-separated query tokens per sequence (MTP / speculative decoding: 2-4; the mean for "
                   "ragged batches); default 1")
    p.add_argument("--causal", choices=tuple(CAUSAL), default="off",
                   help="the calls' causal option: off, on or both; default off")
    p.add_argument("--api", choices=APIS, default="both",
                   help="which entry points the calls use: mla_decode (also plan / DecodePlan.run / mla.ops), "
                   "flash_mla (mla.flash_mla, paged caches only) or both; default both")
    p.add_argument("--a8w8-q", choices=tuple(A8W8_Q), default="bf16",
                   help="a8w8 only: Q as bf16 (quantized on the device, q_format='fp8'), as fp8 codes with their scale "
                   "(q_scale= / descale_q=), or both; default bf16")
    p.add_argument("--target", choices=TARGETS, default="sm_90a",
                   help="sm_90a (H100 / H200; needs nvcc) or gfx942 (MI300X; compiles with ROCm's hipcc, else only "
                   "lowers); default sm_90a")
    p.add_argument("--jobs", type=_positive, default=None,
                   help=f"worker processes, one variant each at a time; default: this machine's cores "
                   f"({default_jobs()})")
    p.add_argument("--cache-dir", default=None,
                   help="TileLang's cache directory (sets TILELANG_CACHE_DIR; created if absent); default: "
                   "$TILELANG_CACHE_DIR, else ~/.tilelang/cache")
    p.add_argument("--only", metavar="GLOB", default=None,
                   help="build only the variants whose name matches this shell pattern (see --list)")
    p.add_argument("--list", action="store_true", help="print the variant names, one per line, and exit (no compile)")
    p.add_argument("--lower-only", action="store_true",
                   help="only lower each variant with TileLang (no device compiler needed, nothing cached)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    spec = spec_for_name(args.target)
    if args.api == "flash_mla" and 0 in args.page_size:
        p.error("--page-size: 0 (a flat cache) is not served by mla.flash_mla (its k_cache is paged); use --api "
                "mla_decode or both, or page sizes 1-128")
    configs = call_variants(spec, modes=args.modes, page_sizes=args.page_size, heads=args.heads, q_lens=args.q_len,
                            causal=CAUSAL[args.causal], api=args.api, a8w8_q=args.a8w8_q)
    if args.only is not None:
        configs = [cfg for cfg in configs if fnmatch.fnmatchcase(cfg.name, args.only)]
        if not configs:
            p.error(f"--only: no variant name matches {args.only!r} (python -m mla.prebuild ... --list prints them)")
    if args.list:
        for cfg in configs:
            print(cfg.name)
        print(f"{len(configs)} kernel variants for {spec.name}", file=sys.stderr)
        return 0

    if args.cache_dir is not None:
        path = os.path.abspath(os.path.expanduser(args.cache_dir))
        if os.path.exists(path) and not os.path.isdir(path):
            p.error(f"--cache-dir: {path} exists and is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            p.error(f"--cache-dir: cannot create {path}: {exc.strerror}")
        os.environ["TILELANG_CACHE_DIR"] = path  # read by TileLang in the workers (spawned with this environment)

    lower_only = args.lower_only
    if not lower_only and find_device_compiler(spec) is None:
        if not spec.is_hip:
            print("mla.prebuild: no CUDA toolkit: nvcc is neither on PATH nor in $CUDA_HOME/bin (or "
                  "/usr/local/cuda/bin). TileLang needs it to compile for sm_90a, also on a CPU-only box: install the "
                  "CUDA toolkit (12.x or later) and put nvcc on PATH. (--list and --lower-only need no compiler.)",
                  file=sys.stderr)
            return 1
        print(f"mla.prebuild: no ROCm (hipcc) on this machine, so nothing can be compiled for {spec.name}: only "
              "lowering each variant with TileLang (nothing is cached). Run this on a ROCm host to fill the cache.",
              file=sys.stderr)
        lower_only = True

    jobs = min(args.jobs or default_jobs(), len(configs))
    print(f"mla.prebuild: {len(configs)} kernel variants for {spec.name} with {jobs} workers"
          + ("" if lower_only else f" into {cache_dir()}"), flush=True)
    results = build(configs, spec, jobs=jobs, lower_only=lower_only, progress=True,
                    log=lambda line: print(line, flush=True))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
