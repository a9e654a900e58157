"""Figures of a bench result with matplotlib (needs the ``paramfold[plot]`` extra).

Only ``--plot`` imports this module, so matplotlib stays optional; it reads results, never runs.
Every file is written through :func:`paramfold.output.atomic_output` (a temporary file beside
the path, renamed when complete, normal permissions), so a failure never leaves a partial image.

Example::

    >>> from paramfold.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1, steady_rounds=1,
    ...                                variants=("baseline", "stock")))
    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "ratios.png"
    >>> plot_ratios(result, out).exists()
    True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paramfold.bench.result import BenchResult, SweepResult
from paramfold.output import atomic_output

__all__ = ["plot_ratios", "plot_sweep", "require_matplotlib"]

_GREY, _BLUE = "#888888", "#3572b0"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install 'paramfold[plot]'"
        ) from exc
    return plt


def require_matplotlib() -> None:
    """Raise ``ImportError`` saying what to install where matplotlib cannot be imported: checked
    before a bench runs, not after its minutes of work."""
    _pyplot()


def _title(result: BenchResult, layers: str) -> str:
    c = result.config
    return (f"{c.model} x{layers}, backend={c.backend}, entry={c.entry}, "
            f"{c.phase.name}")


def _steady_label(result: BenchResult) -> str:
    return result.config.phase.short


def _save(fig: Any, plt: Any, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    try:
        fig.tight_layout()
        with atomic_output(path) as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def plot_ratios(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """Write a PNG of each measured variant's times over the baseline's: two bar charts, the
    first compiled call and the steady time (per call, or per training step with ``--train``).

    Bars are the min/min ratio, a black tick marks the median/median ratio; a line marks 1.0x.
    """
    plt = _pyplot()
    panels = [("first compiled call", "min", "median"),
              (f"steady per {_steady_label(result)}", "steady_min", "steady_median")]
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(4.0, 0.8 * len(result.variants) + 1), 3.6))
    for ax, (what, low, mid) in zip(axes, panels):
        rows = [(v.name, result.ratio(v.name, low), result.ratio(v.name, mid))
                for v in result.variants if result.ratio(v.name, low) is not None]
        names = [r[0] for r in rows]
        mins, meds = [r[1] for r in rows], [r[2] for r in rows]
        bars = ax.bar(names, mins, color=[_GREY if n in ("baseline", "stock") else _BLUE
                                          for n in names])
        ax.scatter(names, meds, marker="_", s=300, color="black", label="median/median", zorder=3)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        for bar, value in zip(bars, mins):
            ax.annotate(f"{value:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(f"{what} / baseline (min/min)")
        ax.set_ylim(0, max([1.0, *mins, *(m for m in meds if m is not None)]) * 1.25)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(_title(result, str(result.config.n_layers)), fontsize=9)
    return _save(fig, plt, path)


def plot_sweep(sweep: SweepResult, path: str | os.PathLike[str]) -> Path:
    """Write a PNG of how each variant's times grow with the number of layers: the first compiled
    call and the steady time against the layer count, log-log, one line per variant (its min over
    repeats or rounds; the whisker reaches the median).

    Example::

        >>> from paramfold.bench import BenchConfig, run_sweep
        >>> s = run_sweep(BenchConfig(repeats=1, steady_calls=1, steady_rounds=1,
        ...                           variants=("baseline", "stock")), [1, 2])
        >>> import tempfile, pathlib
        >>> plot_sweep(s, pathlib.Path(tempfile.mkdtemp()) / "sweep.png").stat().st_size > 0
        True
    """
    plt = _pyplot()
    from matplotlib import ticker

    first = sweep.runs[0]
    panels = [("first compiled call (ms)", "first_call"),
              (f"steady per {_steady_label(first)} (ms)", "steady_call")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (what, stat) in zip(axes, panels):
        for name in sweep.variant_names:
            points = [(r.config.n_layers, getattr(r.variant(name), f"{stat}_min"),
                       getattr(r.variant(name), f"{stat}_median")) for r in sweep.runs]
            points = [p for p in points if p[1] is not None]
            if not points:
                continue
            xs = [p[0] for p in points]
            lows = [p[1] * 1e3 for p in points]
            ups = [(p[2] - p[1]) * 1e3 for p in points]
            ax.errorbar(xs, lows, yerr=[[0.0] * len(ups), ups], marker="o", capsize=3,
                        label=name, linestyle="--" if name in ("baseline", "stock") else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sweep.layers, [str(n) for n in sweep.layers])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_major_formatter(ticker.LogFormatter())
        ax.yaxis.set_minor_formatter(ticker.LogFormatter())  # some minor ticks within a decade
        ax.set_xlabel("layers")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.suptitle(_title(first, ",".join(map(str, sweep.layers))), fontsize=9)
    return _save(fig, plt, path)
