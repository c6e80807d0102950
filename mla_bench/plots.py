"""The PNG a run writes with ``--plot PATH``: achieved GB/s per case, one bar per mode / peer, and the measured read
ceiling as a dashed line. Needs matplotlib (the ``bench`` extra); without it the plot is skipped with one line."""

from __future__ import annotations

from mla_bench.cases import Case
from mla_bench.report import lookup, timed_impls


def write_plot(path: str, rows: list[dict], cases: list[Case], ceiling_gbps: float, title: str) -> None:
    """Bar chart: one group per case, one bar per mode / peer (achieved GB/s), dashed line at the read ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"plot skipped: {exc}")
        return
    impls = timed_impls(rows, ("mode", "peer"))
    if not impls:
        print("plot skipped: nothing was timed")
        return
    bar_width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(cases) + 2), 5))
    for i, impl in enumerate(impls):
        gbps = [(lookup(rows, c.label, impl) or {}).get("gbps", 0.0) for c in cases]
        offsets = [x + (i - (len(impls) - 1) / 2) * bar_width for x in range(len(cases))]
        ax.bar(offsets, gbps, bar_width, label=impl)
    ax.axhline(ceiling_gbps, color="black", linestyle="--", linewidth=1,
               label=f"read ceiling {ceiling_gbps:.0f} GB/s")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.label for c in cases], rotation=30, ha="right")
    ax.set_ylabel("achieved GB/s (own format's bytes)")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"wrote plot to {path}")
