"""The figures, from the JSON records: Figure 5 (validation perplexity against tokens and against time per model, the
mean over seeds with the seeds' range shaded) and one set of labelled axes for the other figures."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from . import curves as C
from .presets import REFERENCE

LABELS = {"updates": "updates", "tokens": "tokens read", "time": "training time at the median load (s)",
          "wall": "wall time (s)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict, path: Path, title: str, xkeys=("tokens", "time")) -> Path:
    """One panel per x axis (`xkeys`: tokens, time, updates or wall) of the models in `results`; PNG at `path`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(xkeys), figsize=(6 * len(xkeys), 4.5))
    axes = list(axes) if len(xkeys) > 1 else [axes]
    for i, (key, m) in enumerate(results.items()):
        style = "-" if key.startswith("smlp") else ("--" if key.startswith("fairseq") else "-.")
        for ax, xkey in zip(axes, xkeys):
            curves = [c for c in m["curves"] if c["ppl"] and c.get(xkey)]
            if not curves:
                continue
            xs, ys = C.mean_curve(curves, xkey)
            line, = ax.plot(xs, ys, style, marker="o", ms=2.5, label=m["name"], color=plt.get_cmap("tab10")(i % 10),
                            lw=2.2 if key == REFERENCE else 1.2)
            if len(curves) > 1:
                ax.fill_between(xs, [min(c["ppl"][j] for c in curves) for j in range(len(xs))],
                                [max(c["ppl"][j] for c in curves) for j in range(len(xs))], color=line.get_color(),
                                alpha=0.15)
    for ax, xkey in zip(axes, xkeys):
        ax.set(xlabel=LABELS[xkey], ylabel="validation perplexity", yscale="log")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


@contextlib.contextmanager
def png_axes(path: Path, title: str, xlabel: str, ylabel: str, *, figsize=(6, 4.5), log2x: bool = False,
             logy: bool = False, legend_size: int = 8) -> Iterator:
    """One set of axes that is labelled, gridded, given its legend and written to `path` (PNG) after the block."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        if log2x:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)
