"""Split an ncu source-page export (per-SASS-instruction counters) of a warp-specialised kernel by role.

The kernels set each role's register budget with setmaxnreg as the role's first instruction: the producers'
``USETMAXREG.DEALLOC``, the MMA warp group's ``USETMAXREG.TRY_ALLOC``. Instructions are assigned, in address order,
to the role of the last marker before them ("common" before the first): nvcc lays each role's branch out as one
block, so this is the role split up to a few shared tail instructions.

On the GPU host (see .device/run24.sh):
    ncu --section SourceCounters --section WarpStateStats -o rep ... python tools/one_call.py fp8 64 8192 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
Then anywhere:
    python tools/ncu_roles.py src.csv [--top 12]
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict

ROLE_MARKERS = (("USETMAXREG.DEALLOC", "producers"), ("USETMAXREG.TRY_ALLOC", "consumer"))
SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def read_rows(path: str) -> tuple[list[str], list[dict]]:
    """The CSV's header and rows (ncu may print lines before the header: skipped up to the line naming Address)."""
    with open(path, newline="") as fh:
        lines = fh.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "Address" in line and "Source" in line)
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    rows = [r for r in reader if r.get("Source")]
    return reader.fieldnames, rows


def split_roles(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by role. A marker seen again starts a role of its own, numbered ("producers", "producers 2", ...): the
    ``fp8_mma`` kernel's copier and V^T transposer are two producer branches, each with its setmaxnreg."""
    roles, role, seen = defaultdict(list), "common", defaultdict(int)
    for r in rows:
        for marker, name in ROLE_MARKERS:
            if marker in r["Source"]:
                seen[name] += 1
                role = name if seen[name] == 1 else f"{name} {seen[name]}"
        roles[role].append(r)
    return roles


def summarize(path: str, top: int = 12) -> str:
    header, rows = read_rows(path)
    metrics = [h for h in header if h not in ("Address", "# Address", "Source") and any(
        _number(r.get(h, "")) is not None for r in rows[:50])]
    stall_cols = [h for h in metrics if h.startswith("stall_") and "Not Issued" not in h]
    out = [f"{path}: {len(rows)} instructions; metrics: {', '.join(metrics)}"]
    roles = split_roles(rows)
    total = sum(_number(r.get(SAMPLES, "")) or 0 for r in rows) or 1
    for role, rs in roles.items():
        samples = sum(_number(r.get(SAMPLES, "")) or 0 for r in rs)
        out.append(f"\n[{role}] {len(rs)} instructions, {samples:.0f} samples ({100 * samples / total:.1f}%)")
        if stall_cols:
            sums = {c: sum(_number(r.get(c, "")) or 0 for r in rs) for c in stall_cols}
            ranked = sorted(sums.items(), key=lambda kv: -kv[1])[:8]
            out.append("  reasons: " + ", ".join(f"{c} {100 * v / max(samples, 1):.0f}%" for c, v in ranked if v))
        hot = sorted(rs, key=lambda r: -(_number(r.get(SAMPLES, "")) or 0))[:top]
        for r in hot:
            s = _number(r.get(SAMPLES, "")) or 0
            reasons = ""
            if stall_cols:
                rr = sorted(((c, _number(r.get(c, "")) or 0) for c in stall_cols), key=lambda kv: -kv[1])[:3]
                reasons = "  " + ", ".join(f"{c} {v:.0f}" for c, v in rr if v)
            out.append(f"  {r.get('Address', r.get('# Address', '?')):>8s} {s:7.0f} {100 * s / total:5.1f}%  "
                       f"{r['Source'][:70]:70s}{reasons}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in args.csv:
        print(summarize(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
