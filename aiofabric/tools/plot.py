"""Plots of bench sweeps: bandwidth and message rate against message size (log2 x-axis), one line per run.

matplotlib is an optional extra (`pip install 'aiofabric[plot]'`); it is imported only when a plot is drawn, with the
Agg backend, so plotting works without a display.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from . import compare
from .bench_report import bandwidth_unit

EXTRA_HINT = "plotting needs matplotlib: pip install 'aiofabric[plot]'"


def check_path(path: str) -> str | None:
    """Why `path` cannot take the plot, found before the run (None: it can)."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"--plot {path}: there is no directory {folder}"
    if os.path.isdir(path):
        return f"--plot {path}: is a directory; name a PNG file"
    return None


def require() -> None:
    """Fail early, naming the extra, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(EXTRA_HINT) from None


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Saved bench results: a `--json-file`, or captured `--json` output (its last line), as compare reads them."""
    runs = [compare.load(path) for path in paths]
    for path, run in zip(paths, runs):
        if "rows" not in run and "bw_MiBps" not in run:
            raise ValueError(f"{path}: not a bench result: no 'rows' or 'bw_MiBps'")
    return runs


def label(run: dict[str, Any]) -> str:
    first = run.get("rows", [run])[0]
    return f"{run.get('test', first.get('test', '?'))} {first.get('qps', '?')} QP x {first.get('depth', '?')}"


def plot_runs(runs: Sequence[dict[str, Any]], path: str, labels: Sequence[str] | None = None,
              report_gbits: bool = False) -> None:
    """Two panels (bandwidth and Mpps against size, log2 x, log10 y) with one line per run; written to `path` (PNG).
    Bandwidth is in the bench table's unit: MiB/sec, or Gb/sec with `report_gbits`."""
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = bandwidth_unit(report_gbits)
    figure, (bandwidth, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, run in enumerate(runs):
        rows = run.get("rows", [run])
        sizes = [row["size"] for row in rows]
        name = labels[index] if labels else label(run)
        bandwidth.plot(sizes, [row["bw_MiBps"] * scale for row in rows], marker="o", label=name)
        rate.plot(sizes, [row["msg_rate"] / 1e6 for row in rows], marker="o", label=name)
    for axes, title in ((bandwidth, f"BW average [{unit}]"), (rate, "message rate [Mpps]")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")  # sizes span 2 B .. 8 MiB: bandwidth spans decades
        axes.set_xlabel("message size [bytes]")
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
