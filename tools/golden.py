"""Golden check of the generated code: a SHA-256 of every kernel variant's generated source, sm_90a CUDA and gfx942
HIP, every family (16/32/64-row decode with its split / direct / fused / FlashMLA-shaped forms, the combine kernel,
the warp-specialised kernel and its decode-stream kernels, the 64-row kernel), compared with the hashes recorded
in ``tests/golden/sources.json``.

A refactor that changes no behaviour must leave every hash unchanged: that is how a kernel change proves itself
without a GPU. A change that is meant to change the code updates the file (``--update``) in the same commit, and
its message says which variants changed and why (``--dump DIR`` writes the sources, to diff two trees).

Lowering needs no device compiler (``mla.jit.lower``), so this runs on a CPU box. The grid (``golden_variants``)
covers every code path of each family: all four modes, split / direct / combine on five (heads, q_tile, causal)
classes, the fused merge and FlashMLA-shaped forms, every page size, and each warp-specialised family. The fused
decode variants take ~50 s each to lower (TileLang's analysis of the grid-barrier merge), the others 1-4 s: the
whole grid takes ~10 minutes on two cores.

    python tools/golden.py                 # check (exit 1 and the differing names if a hash changed)
    python tools/golden.py --update        # record the current hashes
    python tools/golden.py --dump /tmp/src # also write each source to /tmp/src/<target>/<name>.cu|.hip
    python tools/golden.py --only default  # the default problem class only (quick)
    python tools/golden.py --match rows    # the variants whose name contains "rows" (one family, quick)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mla import schedule  # noqa: E402
from mla.constants import MODES  # noqa: E402
from mla.target import spec_for_name  # noqa: E402
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig  # noqa: E402
from tl_kernels.mla_schedule import SplitScheduleConfig  # noqa: E402

GOLDEN_FILE = ROOT / "tests" / "golden" / "sources.json"
TARGETS = ("sm_90a", "gfx942")
# (num_heads, q_tile, causal): the default class first; then MTP tiles of 2 and 4 queries, and 32 / 64 / 128 heads
# (block_h 16 / 32 / 64 rows on sm_90a), causal and not.
CLASSES = ((16, 1, False), (16, 2, True), (32, 1, False), (64, 4, True), (128, 1, False))
PAGE_SIZES = (1, 16, 32, 64, 128)


def golden_variants(target: str, only: str = "all") -> list:
    """The variants whose generated source is recorded, deduplicated by name: kernel configs, and ("stream", cfg,
    mode) for the warp-specialised decode-stream kernels."""
    spec = spec_for_name(target)
    found: dict[str, object] = {}

    def add(*cfgs):
        for cfg in cfgs:
            if cfg is not None:
                found.setdefault(variant_name(cfg), cfg)

    classes = CLASSES[:1] if only == "default" else CLASSES
    for heads, q_tile, causal in classes:
        for kv_format, q_format in MODES.values():
            problem = dict(kv_format=kv_format, q_format=q_format, num_heads=heads, q_tile=q_tile, causal=causal)
            variants = schedule.decode_variants(spec, **problem)
            # The fused merge lowers in ~50 s: the default class carries it for every mode, the others do not.
            add(*(cfg for cfg in variants if (heads, q_tile, causal) == CLASSES[0] or not getattr(cfg, "fused_combine", False)))
    # The default class's warp-specialised kernels (Hopper: the op's default for fp8 / mxfp4 caches from
    # ``schedule.ws_min_tokens``), so CI's default set guards the kernels the largest problems run.
    heads, q_tile, causal = CLASSES[0]
    add(*(cfg for cfg in schedule.kernel_variants(spec, num_heads=heads, q_tile=q_tile, causal=causal)
          if isinstance(cfg, WSDecodeKernelConfig)))
    if only == "default":
        return list(found.values())
    for page_size in PAGE_SIZES:
        for kv_format, q_format in MODES.values():
            add(schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, page_size=page_size, split=True),
                schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, page_size=page_size, split=False))
    add(SplitScheduleConfig())  # mla.flash_mla's split schedule on the device (get_mla_metadata with lengths)
    if spec.is_hip:
        return list(found.values())
    # Hopper only: the fused merge on a paged MTP class, and the FlashMLA-shaped (flash_io) one-launch kernels.
    add(schedule.decode_config(spec, kv_format="bf16", q_tile=2, causal=True, page_size=64, fused_combine=True))
    for kv_format, q_format, heads, q_tile in (("bf16", "bf16", 16, 1), ("fp8", "fp8", 16, 1),
                                               ("mxfp4", "bf16", 16, 1), ("fp8", "bf16", 128, 2)):
        add(schedule.flash_io_variant(schedule.decode_config(
            spec, kv_format=kv_format, q_format=q_format, num_heads=heads, q_tile=q_tile, causal=q_tile > 1,
            page_size=64, fused_combine=True)))
        # The graph form (CUDA graphs): the split kernel reading each sequence's split count, the combine's flash form.
        add(schedule.graph_config(spec, kv_format=kv_format, q_format=q_format, num_heads=heads, q_tile=q_tile,
                                  causal=q_tile > 1, page_size=64),
            *schedule.graph_combine_configs(spec, num_heads=heads))
    # The warp-specialised 16-row kernel (every format, a8w8, causal, paged) and its decode-stream kernels.
    for kv_format, q_format in MODES.values():
        add(schedule.ws_config(spec, kv_format=kv_format, q_format=q_format))
    add(schedule.ws_config(spec, kv_format="mxfp4", causal=True, page_size=64),
        schedule.ws_config(spec, kv_format="fp8", page_size=16))
    # a8w8 on fp8 wgmma (issue 28 step 5): flat, and causal over pages of 64.
    f8mma = dict(fp8_mma=True)
    add(schedule.ws_config(spec, kv_format="fp8", q_format="fp8", **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", causal=True, page_size=64, **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", **f8mma),  # bf16 Q as two e4m3 terms
        # mxfp4 on fp8 wgmma (step 4): e4m3 codes under per-token exponents, flat and causal over pages of 64.
        schedule.ws_config(spec, kv_format="mxfp4", **f8mma),
        schedule.ws_config(spec, kv_format="mxfp4", causal=True, page_size=64, **f8mma),
        # P as two e4m3 terms
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", p_split=True, **f8mma),
        schedule.ws_config(spec, kv_format="mxfp4", p_split=True, **f8mma),
        # mxfp4 with two decoder warp groups (``schedule.MX_RING_2D``): flat, and causal over pages of 64
        schedule.ws_config(spec, kv_format="mxfp4", **schedule.MX_RING_2D),
        schedule.ws_config(spec, kv_format="mxfp4", causal=True, page_size=64, **schedule.MX_RING_2D),
        # bf16 Q's ring causal over pages of 64: not persistent (the op's default before run 62b), and the op's
        # default (``schedule.ws_default_config``; the flat defaults are the default class's, above)
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", causal=True, page_size=64,
                           **schedule.ws_ring_defaults("fp8", "bf16")),
        schedule.ws_default_config(spec, kv_format="fp8", q_format="bf16", causal=True, page_size=64),
        # bf16 Q's two e4m3 terms stacked in one score wgmma (m64n32)
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", p_split=True, q_stack=True, **f8mma),
        # P's two terms stacked in one P V wgmma group (m64n32): a8w8, and bf16 Q with q_stack
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", p_split=True, p_stack=True, **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", p_split=True, q_stack=True, p_stack=True, **f8mma),
        # the MMA warp group one score ahead: a8w8 flat and causal over pages of 64, bf16 Q's two terms, P's two terms
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", score_ahead=True, **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", causal=True, page_size=64, score_ahead=True, **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", score_ahead=True, **f8mma),
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", score_ahead=True, p_split=True, **f8mma),
        # every role's tile step in one copy (``dynamic_stage``): fp8 and a8w8's default rings, causal over pages of
        # 64, and mxfp4's two-decoder ring
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", dynamic_stage=True,
                           **schedule.ws_ring_defaults("fp8", "bf16")),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", causal=True, page_size=64, dynamic_stage=True,
                           **schedule.ws_ring_defaults("fp8", "fp8")),
        schedule.ws_config(spec, kv_format="mxfp4", dynamic_stage=True, **schedule.MX_RING_2D),
        # the V^T ring at two stages beside a deeper codes ring (``vt_stages``): fp8 with three codes stages, a8w8
        # with four, causal over pages of 64
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", dynamic_stage=True, num_stages=3, vt_stages=2,
                           **schedule.ws_ring_defaults("fp8", "bf16")),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", causal=True, page_size=64, dynamic_stage=True,
                           num_stages=4, vt_stages=2, **schedule.ws_ring_defaults("fp8", "fp8")),
        # persistent CTAs (``persistent_ctas``): fp8 flat, a8w8 causal over pages of 64
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", dynamic_stage=True, persistent_ctas=132,
                           **schedule.ws_ring_defaults("fp8", "bf16")),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", causal=True, page_size=64, dynamic_stage=True,
                           persistent_ctas=132, **schedule.ws_ring_defaults("fp8", "fp8")),
        # Q's rows written two per step of a loop (``q_loop_rows``): fp8 (bf16 Q's two terms), a8w8 (codes)
        schedule.ws_config(spec, kv_format="fp8", q_format="bf16", dynamic_stage=True, q_loop_rows=2,
                           **schedule.ws_ring_defaults("fp8", "bf16")),
        schedule.ws_config(spec, kv_format="fp8", q_format="fp8", dynamic_stage=True, q_loop_rows=2,
                           **schedule.ws_ring_defaults("fp8", "fp8")))
    for kv_format in ("fp8", "mxfp4"):
        for mode in ("bench", "check"):
            add(("stream", schedule.ws_config(spec, kv_format=kv_format), mode))
    # The 64-row kernel: 128 / 64 heads, 16 heads x 4 queries over 2 CTAs, causal, paged.
    add(schedule.rows_config(spec, kv_format="bf16", num_heads=128),
        schedule.rows_config(spec, kv_format="bf16", num_heads=64, causal=True),
        schedule.rows_config(spec, kv_format="bf16", num_heads=16, batch=1, total_q=8, causal=True),
        schedule.rows_config(spec, kv_format="bf16", num_heads=128, page_size=64))
    return list(found.values())


def variant_name(variant) -> str:
    if isinstance(variant, tuple):
        _, cfg, mode = variant
        return f"{cfg.name}_stream_{mode}"
    return variant.name


def _prim_func(variant):
    from mla import jit

    if isinstance(variant, tuple):
        from tl_kernels.mla_decode_ws import mla_decode_stream_kernel

        _, cfg, mode = variant
        return mla_decode_stream_kernel(cfg, mode)
    return jit.prim_func(variant)


def generated_source(target: str, variant) -> str:
    """The kernel source TileLang generates for ``variant`` on ``target`` (lowered, no device compiler)."""
    import tilelang
    from tvm import target as tvm_target

    spec = spec_for_name(target)
    with tvm_target.Target(spec.target_dict):
        return tilelang.lower(_prim_func(variant), target=spec.target_dict).kernel_source


# TileLang's shared-memory planner places equal-sized buffers in an order that varies from run to run (the same
# tree lowered twice can swap two 2 KiB buffers, or the reduction workspaces): each buffer is a pointer declared as
# an offset into the dynamic shared memory. ``normalized`` renames those pointers by their first use after the
# declarations and keeps the sorted offsets, so only a permutation of which pointer gets which offset is forgiven:
# any other change of the code (an instruction, an index, an offset, a buffer more or less, two uses that now share a
# buffer) still changes the hash.
_SHMEM_DECL = re.compile(r"^\s*void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);\s*$", re.M)


def normalized(source: str) -> str:
    """``source`` with its dynamic shared-memory pointers renamed canonically (see ``_SHMEM_DECL``). Only the text from
    the first declaration on is renamed: the device functions imported before the kernel use names such as ``dst``
    for their own parameters, which must neither be renamed nor decide the order."""
    first = _SHMEM_DECL.search(source)
    if first is None:
        return source
    head, source = source[: first.start()], source[first.start():]
    decls = _SHMEM_DECL.findall(source)
    offsets = sorted(int(offset) for _, offset in decls)
    body = _SHMEM_DECL.sub("", source)
    names = {name for name, _ in decls}
    order = []
    for match in re.finditer(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b", body):
        if match.group(1) not in order:
            order.append(match.group(1))
    order += sorted(names - set(order))
    canonical = {name: f"__shmem{i}" for i, name in enumerate(order)}
    body = re.sub(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b",
                  lambda m: canonical[m.group(1)], body)
    return f"// dynamic shared memory offsets: {offsets}\n" + head + body


def source_hash(source: str) -> str:
    """SHA-256 of the ``normalized`` source."""
    return hashlib.sha256(normalized(source).encode()).hexdigest()


def _job(args):
    target, variant, dump = args
    start = time.perf_counter()
    try:
        source = generated_source(target, variant)
    except Exception as exc:  # reported per variant, not hidden
        return target, variant_name(variant), None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    if dump:
        suffix = ".hip" if target == "gfx942" else ".cu"
        path = pathlib.Path(dump) / target / f"{variant_name(variant)}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return target, variant_name(variant), source_hash(source), None, time.perf_counter() - start


def compute_hashes(targets=TARGETS, *, only="all", match="", jobs=None, dump=None, log=print) -> tuple[dict, dict]:
    """({"target/name": sha256}, {"target/name": error}) over ``golden_variants`` (those whose name contains
    ``match``), lowered in ``jobs`` processes."""
    work = [(t, v, dump) for t in targets for v in golden_variants(t, only) if match in variant_name(v)]
    # The slow (fused) variants first, so the pool's tail is short.
    work.sort(key=lambda job: not getattr(job[1], "fused_combine", False) or isinstance(job[1], tuple))
    hashes, errors = {}, {}
    jobs = jobs or os.cpu_count() or 1
    # Each variant in a fresh process: TileLang's lowering keeps state between the prim_funcs of one process, and
    # one variant (the warp-specialised mxfp4 causal paged kernel) lowered after others in the same worker gets
    # other shared-memory offsets than alone (seen in two full runs). Children fork from a server that has
    # imported TileLang already, so a fresh process costs ~0.1 s, not the ~3 s of an import.
    # One hash seed for every worker: TileLang numbers some buffers (``dst_2`` / ``dst_3``, ``workspace_*``) in the
    # iteration order of hashed sets, so the same kernel's source differed between runs in those names alone (the
    # warp-specialised mxfp4 causal paged kernel). The forkserver inherits this environment.
    os.environ["PYTHONHASHSEED"] = "0"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tilelang", "mla.jit", "mla.schedule"])
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        for done, (target, name, digest, error, seconds) in enumerate(pool.map(_job, work), 1):
            key = f"{target}/{name}"
            if error:
                errors[key] = error
            else:
                hashes[key] = digest
            log(f"[{done}/{len(work)}] {key} {seconds:.1f} s {'ERROR ' + error if error else digest[:16]}")
    return hashes, errors


def load_golden(path=GOLDEN_FILE) -> dict:
    return json.loads(pathlib.Path(path).read_text())["sources"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="record the current hashes in " + str(GOLDEN_FILE))
    parser.add_argument("--add-new", action="store_true",
                        help="record the hashes of variants not recorded yet (with --match: of those it selects), if "
                             "no recorded one changed: adding a kernel without relowering the whole grid")
    parser.add_argument("--dump", metavar="DIR", help="write every generated source under DIR/<target>/")
    parser.add_argument("--only", choices=("all", "default"), default="all",
                        help="'default': the default problem class only (quick); --update needs 'all'")
    parser.add_argument("--match", default="", help="only the variants whose name contains this (a quick check of the "
                        "family being changed; the whole grid before committing)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {TARGETS}")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: the machine's cores)")
    args = parser.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        parser.error(f"--targets: unknown {bad}; expected a subset of {TARGETS}")
    if args.update and (args.only != "all" or args.match or set(targets) != set(TARGETS)):
        parser.error("--update records the whole grid: use it without --only / --match / --targets")
    start = time.perf_counter()
    hashes, errors = compute_hashes(targets, only=args.only, match=args.match, jobs=args.jobs, dump=args.dump)
    print(f"{len(hashes)} variants lowered in {time.perf_counter() - start:.0f} s, {len(errors)} failed")
    if errors:
        for key, error in sorted(errors.items()):
            print(f"FAILED {key}: {error}")
        return 1
    if args.update:
        import tilelang

        GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN_FILE.write_text(json.dumps({
            "about": "SHA-256 of each variant's generated kernel source (tools/golden.py); tilelang "
                     f"{tilelang.__version__}",
            "sources": dict(sorted(hashes.items())),
        }, indent=1) + "\n")
        print(f"recorded {len(hashes)} hashes in {GOLDEN_FILE.relative_to(ROOT)}")
        return 0
    golden = load_golden()
    changed = sorted(k for k in hashes if k in golden and golden[k] != hashes[k])
    new = sorted(k for k in hashes if k not in golden)
    if args.add_new:
        if changed:
            print("not recording: recorded variants changed: " + ", ".join(changed))
            return 1
        record = json.loads(GOLDEN_FILE.read_text())
        record["sources"] = dict(sorted({**record["sources"], **{k: hashes[k] for k in new}}.items()))
        GOLDEN_FILE.write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded {len(new)} new hashes in {GOLDEN_FILE.relative_to(ROOT)}: " + ", ".join(new))
        return 0
    whole = args.only == "all" and not args.match
    missing = sorted(k for k in golden if k.split("/")[0] in targets and k not in hashes) if whole else []
    for label, keys in (("CHANGED", changed), ("NEW (not recorded)", new), ("GONE (recorded, not built)", missing)):
        for key in keys:
            print(f"{label}: {key}")
    same = len(hashes) - len(changed) - len(new)
    print(f"golden check: {same} unchanged, {len(changed)} changed, {len(new)} new, {len(missing)} gone")
    return 1 if changed or new or missing else 0


if __name__ == "__main__":
    sys.exit(main())
