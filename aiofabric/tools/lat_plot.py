"""`lat --plot PNG`: the latency distribution of a run, with the figures perftest's table reports marked (t_min,
t_typical, 99%, 99.9%, t_max, by samples.summarize: the table's own numbers).

One size: a histogram of the samples (log-spaced bins) and the fraction of samples at least as slow as each latency
(log y: the tail a 99.9% figure comes from). A sweep (-a): each figure against the message size, and one such tail
curve per size. `distributions` is what is drawn, `draw` draws it; matplotlib (the plot extra) is imported only
there, with the Agg backend.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .plot import require
from .samples import summarize

MARKS = (("min", "t_min_us"), ("typical", "t_typical_us"), ("99%", "p99_us"), ("99.9%", "p99_9_us"),
         ("max", "t_max_us"))  # perftest's figures, by the names its table gives them
HISTOGRAM_BINS = 60


@dataclasses.dataclass(frozen=True)
class Distribution:
    """One size's samples, sorted, and perftest's figures of them, both in the plot's unit."""
    size: int
    samples: list[float]
    marks: dict[str, float]

    def slower(self) -> list[float]:
        """For each sorted sample, the fraction of samples at least as slow: 1 down to 1/n (never 0: a log axis)."""
        count = len(self.samples)
        return [(count - index) / count for index in range(count)]


def distributions(samples_by_size: Mapping[int, Sequence[float]], scale: float = 1.0) -> list[Distribution]:
    """What `draw` plots: each size's samples (us, as measured) sorted and times `scale` (the CPU's MHz for -C's
    cycles), with perftest's figures of them; by size."""
    if not samples_by_size:
        raise ValueError("no samples to plot")
    result = []
    for size, samples in sorted(samples_by_size.items()):
        if not samples:
            raise ValueError(f"size {size}: no samples to plot")
        figures = summarize(list(samples))
        result.append(Distribution(size, sorted(sample * scale for sample in samples),
                                   {label: figures[key] * scale for label, key in MARKS}))
    return result


def draw(data: Sequence[Distribution], path: str, unit: str = "usec", title: str = "") -> None:
    """Write `data` to `path` as a PNG (whatever its suffix): two panels, as the module says."""
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = dict(zip((label for label, _ in MARKS), ("-", "--", "-.", ":", "-")))
    if len(data) == 1:
        only = data[0]
        low, high = only.samples[0], only.samples[-1]
        bins = np.geomspace(low, high, HISTOGRAM_BINS) if 0 < low < high else HISTOGRAM_BINS
        left.hist(only.samples, bins=bins, color="tab:blue", alpha=0.6)
        left.set_yscale("log")
        left.set_ylabel("samples")
        left.set_title(f"{only.size} bytes: {len(only.samples)} samples")
        for axes in (left, right):
            for label, value in only.marks.items():
                axes.axvline(value, color="black", linestyle=styles[label], linewidth=1,
                             label=f"{label} {value:.2f}" if axes is left else None)
        left.legend(fontsize="small")
    else:
        sizes = [item.size for item in data]
        for label, _ in MARKS:
            left.plot(sizes, [item.marks[label] for item in data], marker="o", linestyle=styles[label], label=label)
        left.set_xscale("log", base=2)
        left.set_yscale("log")  # 2 B .. 8 MiB: latency spans decades
        left.set_xlabel("message size [bytes]")
        left.set_ylabel(f"latency [{unit}]")
        left.set_title("perftest's figures by size")
        left.legend(fontsize="small")
    colors = plt.get_cmap("viridis")
    for index, item in enumerate(data):  # small sizes dark, large ones light
        right.step(item.samples, item.slower(), where="post", color=colors(index / max(1, len(data) - 1)),
                   label=f"{item.size} B" if len(data) > 1 else None)
    right.set_yscale("log")
    right.set_ylabel("fraction of samples at least this slow")
    right.set_title("the tail")
    if len(data) > 1:
        right.legend(fontsize="x-small", ncol=2)
    for axes in (left, right) if len(data) == 1 else (right,):  # latencies span decades: a log axis
        axes.set_xscale("log")
        axes.set_xlabel(f"latency [{unit}]")
    for axes in (left, right):
        axes.grid(True, which="both", alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
