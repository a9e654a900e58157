"""Figures of a bench result with matplotlib (needs the ``paramfold[plot]`` extra).

Only ``--plot`` imports this module, so matplotlib stays optional; it reads results, never runs.

Example::

    >>> from paramfold.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1,
    ...                                variants=("baseline", "stock")))
    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "ratios.png"
    >>> plot_ratios(result, out).exists()
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from paramfold.bench.result import BenchResult
from paramfold.output import atomic_output

__all__ = ["plot_ratios"]


def plot_ratios(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """Write a PNG bar chart of each measured variant's first-call time over the baseline's.

    Bars are the min/min ratio, whiskers reach the median/median ratio; a line marks 1.0x.  The
    file is written through :func:`paramfold.output.atomic_output` (a temporary file beside
    ``path``, renamed when complete, normal permissions), so a failure never leaves a partial image.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install 'paramfold[plot]'"
        ) from exc

    path = Path(path)
    rows = [(v.name, result.ratio(v.name, "min"), result.ratio(v.name, "median"))
            for v in result.variants if v.samples]
    names = [r[0] for r in rows]
    mins = [r[1] for r in rows]
    meds = [r[2] for r in rows]

    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows) + 1), 3.6))
    try:
        bars = ax.bar(names, mins, color=["#888888" if n in ("baseline", "stock") else "#3572b0"
                                          for n in names])
        ax.scatter(names, meds, marker="_", s=300, color="black", label="median/median", zorder=3)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        for bar, value in zip(bars, mins):
            ax.annotate(f"{value:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("first call / baseline (min/min)")
        c = result.config
        ax.set_title(f"{c.model} x{c.n_layers}, backend={c.backend}, entry={c.entry}, "
                     f"{'train' if c.train else 'eval'}", fontsize=9)
        ax.set_ylim(0, max(v for v in mins + meds if v is not None) * 1.25)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        with atomic_output(path) as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path
