"""How a result is shown: the ``rich`` table, the one-line description, plain progress lines.

Rendering reads a :class:`~paramfold.bench.result.BenchResult` only, so a saved ``--json``
document renders the same as a fresh run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from paramfold.bench.result import BenchResult, VariantResult

__all__ = ["describe_config", "plain_progress", "print_table", "to_rich_table"]


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _diff(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2e}"


def describe_config(result: BenchResult) -> str:
    """One line saying what ``result`` measured and where."""
    c, env = result.config, result.environment
    mode = "train step" if c.train else "eval (no_grad)"
    return (
        f"model={c.model} layers={c.n_layers} width={c.n_width} batch={c.batch} "
        f"backend={c.backend} entry={c.entry} {mode} repeats={c.repeats} "
        f"| torch {env['torch']}, {env['torch_threads']} threads"
        + (f", {c.device} ({env.get('device', '?')})" if c.device != "cpu" else "")
    )


def _notes(v: VariantResult) -> str:
    p = v.proxies
    note = v.note.splitlines()[0][:100] if v.note else ""
    if p is not None and p.recompile_limit_hits:
        note = (note + "; " if note else "") + (
            "hit dynamo's recompile_limit: code past it runs uncompiled"
        )
    if v.samples and not v.proxies_stable:
        note = (note + "; " if note else "") + "proxies differ between repeats (see --json)"
    return note


def to_rich_table(result: BenchResult, *, wide: bool = True) -> Any:
    """A ``rich.table.Table`` of ``result``: first-call times and ratios, steady time, proxies.

    ``wide=False`` is the compact table ``paramfold bench`` prints by default (about 95 columns:
    no CPU-time, prepare-time or note columns; :func:`print_table` prints the notes under it).

    Example::

        >>> from paramfold.bench import BenchConfig, run_bench
        >>> r = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1,
        ...                           variants=("baseline", "stock")))
        >>> to_rich_table(r).row_count, len(to_rich_table(r, wide=False).columns)
        (2, 9)
    """
    from rich import box
    from rich.table import Table

    table = Table(title="paramfold bench: first compiled call (compile + run)",
                  caption=describe_config(result),
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
                  collapse_padding=not wide, pad_edge=wide)
    table.add_column("variant", style="bold", no_wrap=True)
    names = ["first ms\nmin / med", "x baseline\nmin / med"]
    if wide:
        names += ["first cpu\nms (min)", "x baseline\ncpu"]
    names += ["steady\nms/call"]
    if wide:
        names += ["prepare\nms"]
    names += ["graphs", "breaks", "recomp", "ops", "max|diff|\nvs stock"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    if wide:
        table.add_column("note")
    for v in result.variants:
        p = v.proxies
        proxies = ["-"] * 4 if p is None else [
            str(p.graphs), str(p.graph_breaks), str(p.recompiles), str(p.captured_calls)
        ]
        cells = [
            v.name,
            f"{_ms(v.first_call_min)} / {_ms(v.first_call_median)}",
            f"{_ratio(result.ratio(v.name, 'min'))} / {_ratio(result.ratio(v.name, 'median'))}",
        ]
        if wide:
            cells += [_ms(v.first_call_cpu_min), _ratio(result.ratio(v.name, "cpu"))]
        cells += [_ms(v.steady_call_median, 3)]
        if wide:
            cells += [_ms(v.prepare_median, 1)]
        cells += [*proxies, _diff(v.max_abs_diff)]
        if wide:
            cells += [_notes(v)]
        style = {"error": "red", "skipped": "dim"}.get(v.status)
        table.add_row(*cells, style=style)
    return table


def print_table(result: BenchResult, *, wide: bool = False, console: Any = None) -> None:
    """Print the table of ``result`` (compact unless ``wide``) and, if compact, its notes under it.

    The console is ``rich``'s default on a terminal; when writing to a pipe or a file it is as wide
    as ``COLUMNS`` says, else wide enough for the table (nothing wrapped or cut).
    """
    from rich.console import Console
    from rich.markup import escape

    if console is None:
        console = Console()
        if not console.is_terminal and not os.environ.get("COLUMNS"):
            console = Console(width=200)
    console.print(to_rich_table(result, wide=wide))
    if not wide:
        for v in result.variants:
            note = _notes(v)
            if note:
                console.print(f"  {escape(v.name)}: {escape(note)}", highlight=False)
        console.print("  (--wide adds the CPU-time and prepare-time columns)", style="dim",
                      highlight=False)


def plain_progress(stream: Any) -> Callable[[int, int, str], None]:
    """An ``on_progress`` for :func:`run_bench` that writes one plain line per measurement.

    For a log, a CI job or ``| tee``: where ``rich``'s live progress bar would show nothing.

    Example::

        >>> import io
        >>> out = io.StringIO()
        >>> report = plain_progress(out)
        >>> report(0, 12, "warm-up (discarded): baseline")
        >>> out.getvalue().splitlines()
        ['paramfold bench: [ 1/12, 0 s] warm-up (discarded): baseline']
    """
    start = time.perf_counter()

    def report(done: int, total: int, label: str) -> None:
        step = min(done + 1, total) if label != "done" else done
        width = len(str(total))
        stream.write(f"paramfold bench: [{step:>{width}}/{total}, "
                     f"{time.perf_counter() - start:.0f} s] {label}\n")
        stream.flush()

    return report
