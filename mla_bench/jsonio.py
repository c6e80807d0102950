"""The JSON a run writes with ``--json PATH``: ``{"meta": ..., "rows": [...]}``. ``meta`` says where and how the rows
were measured (date, git commit, device, torch / CUDA / HIP versions, the read ceiling, the command line's
arguments, the timing constants); each row is one measurement as ``mla_bench.measure`` and ``mla_bench.host`` fill
it (kinds "mode", "peer", "baseline", "host"). docs/bench/ keeps the JSON of past runs.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import torch

from mla_bench.baselines import BASELINE_MAX_REPS
from mla_bench.timing import FLUSH_BYTES, WARMUP_CALLS

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str | None:
    """The tree's commit: $MLA_GIT_COMMIT where set (a copied tree whose git metadata lags, e.g. the GPU host's),
    else ``git rev-parse``."""
    if os.environ.get("MLA_GIT_COMMIT"):
        return os.environ["MLA_GIT_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def write_json(path: str, rows: list[dict], ceiling: dict, args, device_name: str) -> None:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "read_ceiling": ceiling,
        "args": vars(args),
        "timing": {"warmup_calls": WARMUP_CALLS, "flush_bytes": FLUSH_BYTES, "baseline_max_reps": BASELINE_MAX_REPS},
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print(f"wrote {len(rows)} rows to {path}")
