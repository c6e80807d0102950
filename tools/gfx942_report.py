"""gfx942 (MI300X) code-object report: every dispatchable gfx942 kernel variant, lowered by TileLang, compiled to a
real gfx942 code object with upstream clang, and read back (registers, spills, LDS, occupancy, instruction mix).

Developer step (no AMD GPU needed, but a toolchain CI does not have): Debian's clang-19 / lld-19 / llvm-19 /
rocm-device-libs plus the HIP, clr and rocWMMA headers of ROCm 6.2.2, laid out by
``../shared/gfx942/gfx942_compile.sh --setup`` (its header lists the steps) under ``$GFX942_ROOT`` (default
/tmp/gfx942). Then, from the project root:

    python tools/gfx942_report.py                       # every variant of the test grid (~10 min on 2 cores)
    python tools/gfx942_report.py --set main            # the default class only (9 kernels)
    python tools/gfx942_report.py --only 'split_kvbf16' --no-write
    python tools/gfx942_report.py --source k.cpp        # one HIP file (threads / LDS unknown: give --threads)

Writes ``docs/gfx942.json`` (``{"meta": ..., "variants": [...]}``) and prints the markdown table that
``docs/gfx942.md`` logs per commit (``--md FILE`` also writes it). Per variant: ``vgpr`` (arch VGPRs), ``agpr``,
``sgpr``, ``scratch_bytes`` (per lane), ``spills`` (VGPR + SGPR), ``lds_bytes`` (the lowering's dynamic LDS),
``threads``, ``waves_per_cu`` (whole workgroups per CU under the unified 512-entry VGPR file and 64 KiB of LDS,
times waves per workgroup), ``mfma`` (static ``v_mfma*`` count), and, in the KV loop (the innermost loop of the
disassembly that holds MFMAs): ``vmcnt0_in_loop`` (``s_waitcnt vmcnt(0)``), ``vmcnt0_between_loads`` (those with a
global load of the loop on either side before the loop wraps: a wait that serialises one tile's loads),
``global_loads_in_loop``; over the whole kernel: ``byte_loads`` (global/buffer loads of 1 byte) and ``ds_read_u16``
(LDS reads of 2 bytes or fewer: ``ds_read_u16/i16/u8/i8``, incl. ``_d16`` forms). Per dim_split decode kernel, the
per-tile cycle model (``tile_model``; each wave counted for what it runs): ``valu_per_tile``, ``salu_per_tile``,
``mfma_per_tile``, ``lds_bytes_per_tile``, ``global_bytes_per_token`` (every load of the KV loop) and
``kv_bytes_per_token`` (less the page-table words), ``clocks_per_tile`` (VALU, SALU, MFMA, LDS, L1, HBM clocks of one
32-token tile on one CU), ``bound`` (the largest) and ``roofline_share`` (HBM clocks / bound clocks), beside issue
16's ``tile_budget`` and ``budget_ratio``. Register counts come from upstream LLVM, not AMD's compiler:
indicative. Nothing here runs a kernel.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LDS_PER_CU = 64 * 1024
VGPRS_PER_LANE = 512  # gfx90a / gfx942 wave64: one unified file of arch VGPRs + AGPRs per SIMD lane
VGPR_GRANULE = 8
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4
# Issue 16: what an MI300X issues while HBM delivers one 32-token KV tile. 304 CUs at 2.1 GHz and 5.3 TB/s: about
# 8.3 bytes per clock per CU; the VALU retires about one wave64 instruction per clock per CU (4 SIMDs, 4 clocks each),
# so the tile budget in VALU wave-instructions is the tile's bytes / 8.3. Target: VALU per tile <= 60% of it.
HBM_BYTES_PER_CLK_PER_CU = 5.3e12 / (304 * 2.1e9)
TILE_TOKENS = 32
TILE_BYTES = {"bf16": TILE_TOKENS * 576 * 2, "fp8": TILE_TOKENS * 576, "mxfp4": TILE_TOKENS * (288 + 18)}
BUDGET_TARGET = 0.6
TILES_PER_TRIP = 2  # the dim_split KV loop is unrolled by two tiles
WAVES_PER_TILE = 8  # the 8 wave64s of a workgroup share each tile
FIELDS = ("name", "vgpr", "agpr", "sgpr", "scratch_bytes", "spills", "lds_bytes", "threads", "waves_per_cu", "mfma",
          "vmcnt0_in_loop", "byte_loads", "ds_read_u16")


# ----------------------------------------------------------------------------------------------- variants


def variants(which: str) -> list:
    """Every gfx942 kernel the op can dispatch, deduplicated by name: the default class first, then the test grid
    of tests/test_gfx942.py (heads x q_tile x causal, flat, plus each page size)."""
    from mla import schedule
    from mla.decode import SUPPORTED_PAGE_SIZES
    from mla.target import spec_for_name

    spec = spec_for_name("gfx942")
    classes = [(16, 1, False, 0)]
    if which == "grid":
        classes += [(h, qt, c, 0) for h, qt, c in itertools.product((16, 32, 64, 128), (1, 2, 4), (False, True))]
        classes += [(16, 1, False, ps) for ps in SUPPORTED_PAGE_SIZES]
    seen = {}
    for heads, q_tile, causal, page_size in classes:
        for kv_format, q_format in schedule.MODES.values():
            for split in (True, False):
                cfg = schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, num_heads=heads,
                                             q_tile=q_tile, causal=causal, split=split, page_size=page_size)
                seen.setdefault(cfg.name, cfg)
        cfg = schedule.combine_config(spec, num_heads=heads)
        seen.setdefault(cfg.name, cfg)
    return list(seen.values())


# ----------------------------------------------------------------------------------------------- compile + read


def toolchain(root: Path) -> dict:
    import tilelang

    tl_src = Path(tilelang.__file__).parent / "src"
    missing = [str(p) for p in (root / "include/hip/hip_runtime.h", root / "devlibs/ocml.bc",
                                root / "devlibs/oclc_isa_version_942.bc") if not p.exists()]
    if missing:
        sys.exit(f"gfx942 toolchain incomplete under {root} (see ../shared/gfx942/gfx942_compile.sh --setup): {missing}")
    return dict(root=root, tl_src=tl_src, clang=os.environ.get("CLANG", "clang++-19"),
                suffix=os.environ.get("LLVM_SUFFIX", "-19"))


def compile_hip(src: str, stem: Path, tc: dict) -> tuple[str | None, str, str]:
    """(error or None, disassembly, notes) of one HIP source compiled for gfx942."""
    cpp, hsaco = stem.with_suffix(".cpp"), stem.with_suffix(".hsaco")
    cpp.write_text(src)
    cmd = [tc["clang"], "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "--no-gpu-bundle-output", "-O3",
           "-std=c++17", "-mcode-object-version=5", "-nogpuinc", "-include", "__clang_hip_runtime_wrapper.h",
           "-isystem", str(tc["root"] / "include"), f"--rocm-device-lib-path={tc['root'] / 'devlibs'}",
           f"-I{tc['tl_src']}", "-Rpass-analysis=kernel-resource-usage", "-c", "-o", str(hsaco), str(cpp)]
    hsaco.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    stem.with_suffix(".log").write_text(proc.stderr)
    if proc.returncode or not hsaco.exists():
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        return "\n".join(errors[:8]) or proc.stderr[-2000:], "", ""
    dis = subprocess.run([f"llvm-objdump{tc['suffix']}", "-d", "--mcpu=gfx942", "--symbolize-operands", str(hsaco)],
                         capture_output=True, text=True).stdout
    notes = subprocess.run([f"llvm-readelf{tc['suffix']}", "--notes", str(hsaco)], capture_output=True, text=True).stdout
    stem.with_suffix(".s").write_text(dis)
    return None, dis + "\n;;REMARKS\n" + proc.stderr, notes


def note(notes: str, key: str):
    m = re.search(r"^\s+(?:- )?" + re.escape(key) + r":\s*(\S+)", notes, flags=re.M)
    return int(m.group(1)) if m and m.group(1).lstrip("-").isdigit() else None


def remark(text: str, key: str):
    m = re.search(r"remark:\s+" + re.escape(key) + r":\s*(\d+)", text)
    return int(m.group(1)) if m else None


LOAD = re.compile(r"^\s+(?:global|buffer|flat)_load_(\w+)")
BYTE_LOAD = re.compile(r"^\s+(?:global|buffer|flat)_load_(?:u|s)byte")
NARROW_DS = re.compile(r"^\s+ds_read_(?:u16|i16|u8|i8)\w*")
VMCNT0 = re.compile(r"^\s+s_waitcnt\b.*\bvmcnt\(0\)")
MFMA = re.compile(r"^\s+v_mfma\w*")
SALU = re.compile(r"^\s+s_\w+")
SALU_NOT_ISSUE = re.compile(r"^\s+s_(?:nop|waitcnt|barrier|cbranch_\w+|branch|setprio|sleep|endpgm)\b")


def kv_loop(lines: list[str]) -> list[int] | None:
    """Line indices of the KV loop: the smallest natural loop of the disassembly's control-flow graph (blocks split
    at labels and after branches; a back edge goes to a block that dominates its source) that holds MFMAs. Blocks
    the compiler placed out of line still belong to it."""
    starts = [0]
    for i, line in enumerate(lines):
        if re.match(r"^(?:[0-9a-f]+ )?<(L\d+)>:", line.strip()):
            starts.append(i)
        elif re.match(r"^\s+s_(?:cbranch_\w+|branch|endpgm)\b", line):
            starts.append(i + 1)
    starts = sorted(set(s for s in starts if s < len(lines)))
    blocks = [(a, b) for a, b in zip(starts, starts[1:] + [len(lines)])]
    label_block = {}
    for k, (a, b) in enumerate(blocks):
        m = re.match(r"^(?:[0-9a-f]+ )?<(L\d+)>:", lines[a].strip())
        if m:
            label_block[m.group(1)] = k
    succ = {k: [] for k in range(len(blocks))}
    for k, (a, b) in enumerate(blocks):
        last = next((lines[i] for i in range(b - 1, a - 1, -1) if lines[i].strip()), "")
        m = re.match(r"^\s+s_(cbranch_\w+|branch)\s+(L\d+)", last)
        if m and m.group(2) in label_block:
            succ[k].append(label_block[m.group(2)])
        if not (m and m.group(1) == "branch") and not re.match(r"^\s+s_endpgm", last) and k + 1 < len(blocks):
            succ[k].append(k + 1)
    pred = {k: [] for k in succ}
    for k, vs in succ.items():
        for v in vs:
            pred[v].append(k)
    # Dominators (iterative; the entry is block 0), then the natural loop of every back edge latch -> header
    # (header dominates latch): blocks are placed in any order, so addresses say nothing about loops.
    reach, stack = {0}, [0]
    while stack:
        for v in succ[stack.pop()]:
            if v not in reach:
                reach.add(v)
                stack.append(v)
    dom = {k: ({0} if k == 0 else set(reach)) for k in reach}
    changed = True
    while changed:
        changed = False
        for k in sorted(reach - {0}):
            new = set.intersection(*(dom[p] for p in pred[k] if p in reach))
            new = new | {k}
            if new != dom[k]:
                dom[k], changed = new, True
    best = None
    for latch in reach:
        for header in succ[latch]:
            if header not in dom[latch]:
                continue
            body, stack = {header, latch}, [latch]
            while stack:  # natural loop: everything that reaches the latch without passing the header
                for p in pred[stack.pop()]:
                    if p in reach and p not in body:
                        body.add(p)
                        stack.append(p)
            idx = [i for k in sorted(body) for i in range(*blocks[k])]
            if any(MFMA.match(lines[i]) for i in idx) and (best is None or len(idx) < len(best)):
                best = idx
    return best


def analyse(dis: str, notes: str) -> dict:
    text, _, remarks = dis.partition("\n;;REMARKS\n")
    lines = text.splitlines()
    res = dict(
        vgpr=remark(remarks, "VGPRs"), agpr=note(notes, ".agpr_count"), sgpr=note(notes, ".sgpr_count"),
        vgpr_total=note(notes, ".vgpr_count"), scratch_bytes=note(notes, ".private_segment_fixed_size"),
        spills=(note(notes, ".vgpr_spill_count") or 0) + (note(notes, ".sgpr_spill_count") or 0),
        mfma=sum(1 for x in lines if MFMA.match(x)),
        mfma_kinds=sorted({MFMA.match(x).group(0).strip() for x in lines if MFMA.match(x)}),
        byte_loads=sum(1 for x in lines if BYTE_LOAD.match(x)),
        ds_read_u16=sum(1 for x in lines if NARROW_DS.match(x)),
        global_loads=sum(1 for x in lines if LOAD.match(x)),
    )
    loop = kv_loop(lines)
    if loop is None:
        res.update(vmcnt0_in_loop=None, vmcnt0_between_loads=None, global_loads_in_loop=0, load_kinds_in_loop=[])
        return res
    body = [lines[i] for i in loop]  # in address order
    is_load = [bool(LOAD.match(x)) for x in body]
    waits = [i for i, x in enumerate(body) if VMCNT0.match(x)]
    # A wait between loads: a load of the loop before it and another after it in the same trip.
    between = [i for i in waits if any(is_load[:i]) and any(is_load[i + 1:])]
    res.update(
        vmcnt0_in_loop=len(waits), vmcnt0_between_loads=len(between), global_loads_in_loop=sum(is_load),
        load_kinds_in_loop=sorted({LOAD.match(x).group(1) for x in body if LOAD.match(x)}),
        loop_instructions=len(body),
        mfma_in_loop=sum(1 for x in body if MFMA.match(x)),
        valu_in_loop=sum(1 for x in body if re.match(r"^\s+v_(?!mfma)", x)),
        cvt_in_loop=sum(1 for x in body if re.match(r"^\s+v_cvt", x)),
        lds_ops_in_loop=sum(1 for x in body if re.match(r"^\s+ds_", x)),
        barriers_in_loop=sum(1 for x in body if re.match(r"^\s+s_barrier", x)),
        salu_in_loop=sum(1 for x in body if SALU.match(x) and not SALU_NOT_ISSUE.match(x)),
        valu_kinds_in_loop=dict(sorted(collections.Counter(
            m.group(1) for m in (re.match(r"^\s+(v_(?!mfma)\w+)", x) for x in body) if m).items())),
    )
    return res


# ----------------------------------------------------------------------------------------------- per-tile cycle model
# What one CU does for one 32-token KV tile (issue 31), from the code object's KV loop (one trip = TILES_PER_TRIP
# tiles, every wave of the workgroup runs it; blocks that only wave 0 runs are counted once, see wave0_lines), each
# unit's work turned into CU clocks. MI300X figures (CDNA3: 304 CUs, 2.1 GHz, 4 SIMDs per CU):
# - VALU: each SIMD issues one wave64 VALU instruction per 4 clocks, so the CU retires 1 per clock; transcendentals
#   (v_exp, v_log, v_rcp, v_rsq, v_sqrt, v_sin, v_cos) are quarter rate: 4 clocks each.
# - SALU: one scalar unit per CU, one instruction per clock (waits, nops, branches and barriers not counted).
# - MFMA: clocks of one SIMD's matrix core per instruction, MFMA_CLOCKS, spread over the 4 SIMDs. 16x16x16 bf16 and
#   16x16x32 fp8 take 16 clocks each: AMD's MI300X dense peaks (1307 TFLOP/s bf16, 2615 fp8) at 2.1 GHz over 304 x 4
#   SIMDs are 512 / 1024 flops per SIMD clock, and the instructions are 8192 / 16384 flops. (LLVM's gfx942
#   scheduling model says 8 clocks of latency and an issue every 4: it models the pipeline, not the rate.)
# - LDS: 128 bytes per clock per CU, reads and writes (ds_bpermute / ds_swizzle: 4 bytes per lane).
# - L1 (vector memory): 64 bytes per clock per CU of what the loads ask for, redundant bytes included.
# - HBM: the tile's bytes in the cache format at 5.3 TB/s shared by 304 CUs (HBM_BYTES_PER_CLK_PER_CU).
# The bound is the unit with the most clocks; the predicted share of the read roofline is HBM clocks / bound clocks
# (1.0 when HBM bounds the tile). A model: no latency, no bank conflicts, no overlap limits.
VALU_QUARTER_RATE = re.compile(r"^\s+v_(?:exp|log|rcp|rsq|sqrt|sin|cos)_")
MFMA_CLOCKS = {"v_mfma_f32_16x16x16_bf16": 16, "v_mfma_f32_16x16x32_fp8_fp8": 16}
LDS_BYTES_PER_CLK = 128
L1_BYTES_PER_CLK = 64
LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "ushort": 2, "sshort": 2, "dword": 4, "dwordx2": 8, "dwordx3": 12,
              "dwordx4": 16}
DS_BYTES = re.compile(r"^\s+ds_(read|write)(2st64|2)?_(b32|b64|b96|b128|u8|i8|u16|i16|u16_d16\w*|u8_d16\w*)")
DS_WIDTH = {"b32": 4, "b64": 8, "b96": 12, "b128": 16, "u8": 1, "i8": 1, "u16": 2, "i16": 2}
DS_PERMUTE = re.compile(r"^\s+ds_(?:bpermute|permute|swizzle)_b32")
# Paged kernels: page-table dwords each lane loads per tile (mla_decode_gfx942.DS_PAGE_LOADS_PER_TILE); they are
# reported apart from the cache bytes (global_bytes_per_token counts them, kv_bytes_per_token does not).
FORMAT_BYTES_PER_TOKEN = {k: v // TILE_TOKENS for k, v in TILE_BYTES.items()}


def wave0_lines(lines: list[str]) -> set[int]:
    """Indices of the lines only wave 0 runs: the blocks between ``s_and_saveexec_b64 _, sX`` + ``s_cbranch_execz L``
    and L, where sX holds ``v_cmp_gt_u32 sX, N, v0`` (threadIdx.x < N <= 64) taken while v0 was still threadIdx.x
    and not written again. The other waves run the mask and the branch only (counted for them)."""
    masks, v0_live, writes = {}, True, collections.defaultdict(list)
    for i, x in enumerate(lines):
        m = re.match(r"^\s+v_cmp_gt_u32_e64\s+(s\[\d+:\d+\]),\s*(\d+),\s*v0\b", x)
        if m and v0_live and int(m.group(2)) <= 64:
            masks[m.group(1)] = i
        m = re.match(r"^\s+[sv]_\w+\s+(s\[\d+:\d+\]|v\d+|v\[\d+:\d+\])", x)
        if m:
            writes[m.group(1)].append(i)
            if m.group(1) == "v0" or m.group(1).startswith("v[0:"):
                v0_live = False
    # the mask must not be written again after the compare (anywhere later in the kernel: blocks are out of order)
    masks = {s for s, i in masks.items() if max(writes[s]) == i}
    out = set()
    for i, x in enumerate(lines):
        m = re.match(r"^\s+s_and_saveexec_b64\s+s\[\d+:\d+\],\s*(s\[\d+:\d+\])", x)
        if not (m and m.group(1) in masks and i + 1 < len(lines)):
            continue
        b = re.match(r"^\s+s_cbranch_execz\s+(L\d+)", lines[i + 1])
        if not b:
            continue
        for k in range(i + 2, len(lines)):
            if re.match(r"^(?:[0-9a-f]+ )?<" + b.group(1) + r">:", lines[k].strip()):
                break
            out.add(k)
    return out


def tile_model(res: dict, cfg, lines: list[str], loop: list[int]) -> None:
    """The per-tile fields of a dim_split kernel (issue 16's VALU budget, issue 31's cycle model), per wave what that
    wave runs. valu_per_tile / tile_budget = budget_ratio keeps issue 16's definition (one clock per VALU
    instruction, target <= BUDGET_TARGET)."""
    if not getattr(cfg, "dim_split", False):
        return
    only0 = wave0_lines(lines)
    waves = cfg.threads // 64
    counts = collections.Counter()
    lds_bytes = load_bytes = 0.0
    for i in loop:
        x = lines[i]
        w = 1 if i in only0 else waves
        if MFMA.match(x):
            counts["mfma"] += w
            counts["mfma_clocks"] += w * MFMA_CLOCKS.get(MFMA.match(x).group(0).strip(), 16)
        elif re.match(r"^\s+v_", x):
            counts["valu"] += w
            counts["valu_clocks"] += w * (4 if VALU_QUARTER_RATE.match(x) else 1)
        elif SALU.match(x) and not SALU_NOT_ISSUE.match(x):
            counts["salu"] += w
        m = LOAD.match(x)
        if m:
            load_bytes += w * 64 * LOAD_BYTES.get(m.group(1), 4)
        m = DS_BYTES.match(x)
        if m:
            width = DS_WIDTH.get(m.group(3)[:3] if m.group(3)[:3] in DS_WIDTH else m.group(3), 2)
            lds_bytes += w * 64 * width * (2 if m.group(2) else 1)
        elif DS_PERMUTE.match(x):
            lds_bytes += w * 64 * 4
    per = 1 / TILES_PER_TRIP
    from tl_kernels import mla_decode_gfx942 as ds

    page_bytes = (ds.DS_PAGE_LOADS_PER_TILE * 4 * cfg.threads / TILE_TOKENS) if cfg.page_size else 0
    tile_hbm = TILE_BYTES[cfg.kv_format] / HBM_BYTES_PER_CLK_PER_CU
    clocks = dict(valu=counts["valu_clocks"] * per, salu=counts["salu"] * per,
                  mfma=counts["mfma_clocks"] * per / SIMDS_PER_CU, lds=lds_bytes * per / LDS_BYTES_PER_CLK,
                  l1=load_bytes * per / L1_BYTES_PER_CLK, hbm=tile_hbm)
    bound = max(clocks, key=clocks.get)
    res.update(
        valu_per_tile=round(counts["valu"] * per), salu_per_tile=round(counts["salu"] * per),
        mfma_per_tile=round(counts["mfma"] * per), tile_budget=round(tile_hbm),
        budget_ratio=round(counts["valu"] * per / tile_hbm, 3),
        lds_bytes_per_tile=round(lds_bytes * per), wave0_only_lines_in_loop=len(only0 & set(loop)),
        global_bytes_per_token=round(load_bytes * per / TILE_TOKENS, 1),
        kv_bytes_per_token=round(load_bytes * per / TILE_TOKENS - page_bytes, 1),
        format_bytes_per_token=FORMAT_BYTES_PER_TOKEN[cfg.kv_format],
        clocks_per_tile={k: round(v) for k, v in clocks.items()}, bound=bound,
        roofline_share=round(min(1.0, tile_hbm / clocks[bound]), 3),
    )


def occupancy(vgpr_total, lds_bytes: int, threads: int) -> dict:
    if not vgpr_total:
        return {}
    alloc = -(-vgpr_total // VGPR_GRANULE) * VGPR_GRANULE
    waves_simd = min(MAX_WAVES_PER_SIMD, VGPRS_PER_LANE // alloc)
    waves_wg = -(-threads // 64)
    wg_cu = min((waves_simd * SIMDS_PER_CU) // waves_wg, LDS_PER_CU // lds_bytes if lds_bytes else 10**9)
    return dict(waves_per_cu=wg_cu * waves_wg, vgpr_waves_per_simd=waves_simd)


def report_variant(cfg, spec, out: Path, tc: dict) -> dict:
    from mla import jit

    res = dict(name=cfg.name, threads=cfg.threads)
    try:
        artifact = jit.lower(cfg, spec)
    except Exception as exc:  # reported, not hidden
        res.update(ok=False, error=f"lower: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
        return res
    res["lds_bytes"] = jit.lowered_lds_bytes(artifact)
    error, dis, notes = compile_hip(str(artifact.kernel_source), out / cfg.name, tc)
    if error:
        res.update(ok=False, error=f"compile: {error}")
        return res
    res.update(analyse(dis, notes))
    res.update(occupancy(res.get("vgpr_total"), res["lds_bytes"], cfg.threads))
    lines = dis.partition("\n;;REMARKS\n")[0].splitlines()
    loop = kv_loop(lines)
    if loop is not None:
        tile_model(res, cfg, lines, loop)
    res["ok"] = True
    return res


# ----------------------------------------------------------------------------------------------- output


def short(name: str) -> str:
    return name.replace("mla_decode_", "").replace("_fnuz", "")


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"Report of `{meta['commit']}` ({meta['date']}, {meta['clang']}, TileLang {meta['tilelang']}): "
        f"{len(results)} variants, {sum(r.get('ok', False) for r in results)} compiled.",
        "",
        "| variant | VGPR | AGPR | SGPR | scratch | spills | LDS B | thr | waves/CU | mfma | vmcnt0 in loop "
        "(between loads) | loads in loop | byte loads | ds_read_u16 | VALU/tile | SALU/tile | budget | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| `{short(r['name'])}` | **{r.get('error', 'failed')[:120]}** |" + " |" * 17)
            continue
        cells = [r.get(k) for k in ("vgpr", "agpr", "sgpr", "scratch_bytes", "spills", "lds_bytes", "threads",
                                    "waves_per_cu", "mfma")]
        cells.append(f"{r.get('vmcnt0_in_loop')} ({r.get('vmcnt0_between_loads')})")
        cells += [r.get("global_loads_in_loop"), r.get("byte_loads"), r.get("ds_read_u16"), r.get("valu_per_tile"),
                  r.get("salu_per_tile"), r.get("tile_budget"), r.get("budget_ratio")]
        lines.append(f"| `{short(r['name'])}` | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    decode = [r for r in results if r.get("ok") and r["name"].startswith("mla_decode")]
    if decode:
        def span(key):
            vals = [r.get(key) for r in decode if r.get(key) is not None]
            return f"{min(vals)}-{max(vals)}" if vals and min(vals) != max(vals) else (str(vals[0]) if vals else "-")
        kinds = sorted({k for r in decode for k in r.get("mfma_kinds", [])})
        lines += ["", f"Decode kernels ({len(decode)}): waves/CU {span('waves_per_cu')}, VGPR {span('vgpr')}, "
                      f"AGPR {span('agpr')}, LDS {span('lds_bytes')} B, spills {span('spills')}, "
                      f"scratch {span('scratch_bytes')} B, vmcnt(0) in the KV loop {span('vmcnt0_in_loop')} "
                      f"(between loads {span('vmcnt0_between_loads')}), byte loads {span('byte_loads')}, "
                      f"ds_read_u16 {span('ds_read_u16')}; MFMA kinds: {', '.join(kinds)}."]
    model = [r for r in decode if r.get("clocks_per_tile")]
    if model:
        lines += ["", "Per-tile cycle model (one CU, one 32-token tile, clocks; bound = the unit with the most clocks; "
                      "share = HBM clocks / bound clocks):", "",
                  "| variant | VALU/tile | ratio | SALU/tile | MFMA/tile | LDS B/tile | global B/token (KV) | format B "
                  "| VALU clk | SALU clk | MFMA clk | LDS clk | L1 clk | HBM clk | bound | share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in model:
            c = r["clocks_per_tile"]
            kv = r["kv_bytes_per_token"]
            gb = f"{r['global_bytes_per_token']}" + (f" ({kv})" if kv != r["global_bytes_per_token"] else "")
            lines.append(f"| `{short(r['name'])}` | {r['valu_per_tile']} | {r['budget_ratio']} | {r['salu_per_tile']} | "
                         f"{r['mfma_per_tile']} | {r['lds_bytes_per_tile']} | {gb} | {r['format_bytes_per_token']} | "
                         f"{c['valu']} | {c['salu']} | {c['mfma']} | {c['lds']} | {c['l1']} | {c['hbm']} | "
                         f"{r['bound']} | {r['roofline_share']} |")
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> list[str]:
    """The issue's targets that some decode variant misses (empty: all met)."""
    misses = []
    for r in results:
        if not r["name"].startswith("mla_decode"):
            continue
        if not r.get("ok"):
            misses.append(f"{r['name']}: does not compile")
            continue
        checks = {"waves/CU >= 8": (r.get("waves_per_cu") or 0) >= 8, "0 spills": r.get("spills") == 0,
                  "0 scratch": r.get("scratch_bytes") == 0, "LDS <= 64 KiB": r.get("lds_bytes", 0) <= LDS_PER_CU,
                  "no vmcnt(0) between loads in the KV loop": r.get("vmcnt0_between_loads") == 0,
                  "no byte loads": r.get("byte_loads") == 0, "no ds_read_u16": r.get("ds_read_u16") == 0}
        if r.get("budget_ratio") is not None and "_h16_" in r["name"] and "_qt1_" in r["name"]:
            checks[f"VALU per tile <= {BUDGET_TARGET:.0%} of the tile budget"] = r["budget_ratio"] <= BUDGET_TARGET
            checks["bound HBM"] = r.get("bound") == "hbm"
            checks["KV bytes per token within 5% of the format's"] = (
                abs(r["kv_bytes_per_token"] / r["format_bytes_per_token"] - 1) <= 0.05)
        misses += [f"{r['name']}: {k}" for k, ok in checks.items() if not ok]
    return misses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("main", "grid"), default="grid")
    p.add_argument("--only", default=None, help="regex on the variant name")
    p.add_argument("--source", type=Path, default=None, help="report one HIP file instead of the variants")
    p.add_argument("--threads", type=int, default=128, help="with --source: threads per workgroup")
    p.add_argument("--lds", type=int, default=0, help="with --source: dynamic LDS bytes")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("GFX942_ROOT", "/tmp/gfx942")) / "report")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "gfx942.json")
    p.add_argument("--md", type=Path, default=None, help="also write the markdown table here")
    p.add_argument("--no-write", action="store_true", help="print only (no docs/gfx942.json)")
    args = p.parse_args()
    tc = toolchain(Path(os.environ.get("GFX942_ROOT", "/tmp/gfx942")))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.source:
        error, dis, notes = compile_hip(args.source.read_text(), args.out / args.source.stem, tc)
        res = dict(name=args.source.stem, threads=args.threads, lds_bytes=args.lds)
        res.update(dict(ok=False, error=error) if error else dict(ok=True, **analyse(dis, notes)))
        res.update(occupancy(res.get("vgpr_total"), args.lds, args.threads))
        print(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1
    from mla.target import spec_for_name

    import tilelang

    # The commit the variants are lowered from (read before lowering: later commits do not change this run).
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", "mla",
                            "tl_kernels", "tools/gfx942_report.py"], capture_output=True, text=True).stdout.strip()
    clang = subprocess.run([tc["clang"], "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    meta = dict(commit=commit + ("+dirty" if dirty else ""), date=time.strftime("%Y-%m-%d %H:%M"), clang=clang,
                tilelang=tilelang.__version__, set=args.set, only=args.only)
    spec = spec_for_name("gfx942")
    cfgs = [c for c in variants(args.set) if not args.only or re.search(args.only, c.name)]
    results = []
    for i, cfg in enumerate(cfgs, 1):
        t0 = time.perf_counter()
        r = report_variant(cfg, spec, args.out, tc)
        results.append(r)
        print(f"[{i}/{len(cfgs)}] {r['name']}: " + (", ".join(f"{k}={r.get(k)}" for k in FIELDS[1:] + (
            "vmcnt0_between_loads", "valu_per_tile", "salu_per_tile", "tile_budget", "budget_ratio",
            "kv_bytes_per_token", "bound", "roofline_share", "clocks_per_tile"))
              if r.get("ok") else r.get("error", "failed")) + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    md = markdown(results, meta)
    print(md)
    misses = targets(results)
    print("targets: " + ("all met for every decode variant" if not misses else f"{len(misses)} misses:\n  " + "\n  ".join(misses)))
    if not args.no_write:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(meta=meta, variants=results), indent=1) + "\n")
    if args.md:
        args.md.write_text(md)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
