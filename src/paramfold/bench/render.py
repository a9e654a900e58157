"""How a result is shown: the ``rich`` tables, the one-line description, plain progress lines.

Rendering reads a :class:`~paramfold.bench.result.BenchResult` (or a
:class:`~paramfold.bench.result.SweepResult`) only, so a saved ``--json`` document renders the
same as a fresh run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from paramfold.bench.result import BenchResult, SweepResult, VariantResult

__all__ = [
    "describe_config",
    "plain_progress",
    "print_sweep",
    "print_table",
    "to_rich_table",
    "to_sweep_tables",
]


def _ms(seconds: float | None, digits: int | None = 0) -> str:
    """Milliseconds with ``digits`` decimals (``None``: 3, fewer from 10 ms on, for steady times)."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if digits is None:
        digits = 3 if ms < 10 else 2 if ms < 100 else 1
    return f"{ms:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _diff(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2e}"


def _describe(result: BenchResult, layers: str) -> str:
    c, env = result.config, result.environment
    mode = c.phase.label
    return (
        f"model={c.model} layers={layers} width={c.n_width} batch={c.batch} "
        f"backend={c.backend} entry={c.entry} {mode} repeats={c.repeats} "
        f"| torch {env['torch']}, {env['torch_threads']} threads"
        + (f", {c.device} ({env.get('device', '?')})" if c.device != "cpu" else "")
    )


def describe_config(result: BenchResult) -> str:
    """One line saying what ``result`` measured and where."""
    return _describe(result, str(result.config.n_layers))


def _steady_what(result: BenchResult) -> str:
    return result.config.phase.steady_what


def _how(result: BenchResult) -> str:
    """What min / med are taken over, for under a table."""
    c = result.config
    return (f"min / med: first call over {c.repeats} repeat(s), steady over {c.steady_rounds} "
            f"interleaved round(s) of {c.steady_calls} {c.phase.count}")


def _notes(v: VariantResult) -> str:
    p = v.proxies
    notes = [v.note.splitlines()[0][:100]] if v.note else []
    if p is not None and p.recompile_limit_hits:
        notes.append("hit dynamo's recompile_limit: code past it runs uncompiled")
    if v.samples and not v.proxies_stable:
        notes.append("proxies differ between repeats (see --json)")
    if v.steady_compiles:
        notes.append(f"compiled {v.steady_compiles} graph(s) during the steady rounds")
    return "; ".join(notes)


def _pair(low: str, mid: str) -> str:
    return "-" if low == mid == "-" else f"{low} / {mid}"


def _min_med(v: VariantResult, which: str, digits: int | None) -> str:
    return _pair(_ms(getattr(v, f"{which}_min"), digits), _ms(getattr(v, f"{which}_median"), digits))


def _ratios(result: BenchResult, name: str, low: str, mid: str) -> str:
    return _pair(_ratio(result.ratio(name, low)), _ratio(result.ratio(name, mid)))


def to_rich_table(result: BenchResult, *, wide: bool = True) -> Any:
    """A ``rich.table.Table`` of ``result``: first-call and steady times as ratios to the baseline.

    Per variant: the first compiled call (ms, and min / median as a ratio to the baseline's), the
    steady time (per call, or per training step with ``train``) as a ratio to the baseline's, the
    proxies and the max |difference| from stock. ``wide=False`` is the compact table ``paramfold
    bench`` prints by default (under 100 columns: no CPU-time, steady-ms, prepare-time or note
    columns; :func:`print_table` prints the notes under it).

    Example::

        >>> from paramfold.bench import BenchConfig, run_bench
        >>> r = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1, steady_rounds=1,
        ...                           variants=("baseline", "stock")))
        >>> to_rich_table(r).row_count, len(to_rich_table(r, wide=False).columns)
        (2, 9)
    """
    from rich import box
    from rich.table import Table

    table = Table(title=f"paramfold bench: first compiled call (compile + run), steady "
                        f"{_steady_what(result)}",
                  caption=describe_config(result),
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
                  collapse_padding=not wide, pad_edge=wide)
    table.add_column("variant", style="bold", no_wrap=True)
    names = ["first ms\nmin / med", "first call\nx baseline"]
    if wide:
        names += ["first cpu\nms (min)", "x baseline\ncpu"]
    names += ["steady\nx baseline"]
    if wide:
        names += ["steady ms\nmin / med", "prepare\nms"]
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
        cells = [v.name, _min_med(v, "first_call", 0), _ratios(result, v.name, "min", "median")]
        if wide:
            cells += [_ms(v.first_call_cpu_min), _ratio(result.ratio(v.name, "cpu"))]
        cells += [_ratios(result, v.name, "steady_min", "steady_median")]
        if wide:
            cells += [_min_med(v, "steady_call", None), _ms(v.prepare_median, 1)]
        cells += [*proxies, _diff(v.max_abs_diff)]
        if wide:
            cells += [_notes(v)]
        table.add_row(*cells, style=_STYLES.get(v.status))
    return table


_STYLES = {"error": "red", "skipped": "dim"}


def _console(console: Any) -> Any:
    """``console``, else rich's default on a terminal; on a pipe or a file as wide as ``COLUMNS``
    says, else wide enough for the table (nothing wrapped or cut)."""
    from paramfold.terminal import stdout_console

    return console or stdout_console(200)


def _print_whole(console: Any, table: Any) -> None:
    """Print ``table`` at its full width, also where the console is narrower (an 80-column
    terminal): its lines then run past the edge, and the terminal wraps them, instead of rich
    cutting numbers to "1.0…"."""
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    narrow = console.width
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = narrow


def _say(console: Any, text: str, **style: Any) -> None:
    from rich.markup import escape

    console.print(f"  {escape(text)}", highlight=False, **style)


def print_table(result: BenchResult, *, wide: bool = False, console: Any = None) -> None:
    """Print the table of ``result`` (compact unless ``wide``), what min / med are taken over,
    and, if compact, the notes under it."""
    console = _console(console)
    _print_whole(console, to_rich_table(result, wide=wide))
    _say(console, _how(result))
    base = result.variant("baseline")
    _say(console, f"baseline steady: {_min_med(base, 'steady_call', 3)} ms "
                  f"per {result.config.phase.short}")
    if not wide:
        for v in result.variants:
            note = _notes(v)
            if note:
                _say(console, f"{v.name}: {note}")
        _say(console, "(--wide adds the CPU-time, steady-ms and prepare-time columns)", style="dim")


def to_sweep_tables(sweep: SweepResult) -> list[Any]:
    """Two ``rich.table.Table`` of a sweep, one row per layer count: the first compiled call and
    the steady time, the baseline's in ms and every other variant's as a ratio to it (min / med).
    A variant skipped at every size (freeze with ``train`` or ``grad``) has no column; the notes say why.

    Example::

        >>> from paramfold.bench import BenchConfig, run_sweep
        >>> s = run_sweep(BenchConfig(repeats=1, steady_calls=1, steady_rounds=1,
        ...                           variants=("baseline", "stock")), [1, 2])
        >>> [(t.row_count, len(t.columns)) for t in to_sweep_tables(s)]
        [(2, 3), (2, 3)]
    """
    from rich import box
    from rich.table import Table

    first = sweep.runs[0]
    layers = ",".join(map(str, sweep.layers))
    tables = []
    for title, stat, unit, digits in (
        ("first compiled call (compile + run)", "first_call", "ms", 0),
        (f"steady {_steady_what(first)}", "steady_call", "ms", None),
    ):
        low, mid = ("min", "median") if stat == "first_call" else ("steady_min", "steady_median")
        title = f"paramfold bench --sweep-layers {layers}: {title}"
        table = Table(title=title, min_width=len(title), box=box.SIMPLE_HEAD,
                      collapse_padding=True, pad_edge=False)
        table.add_column("layers", justify="right", no_wrap=True)
        table.add_column(f"baseline\n{unit} min / med", justify="right", no_wrap=True)
        names = [n for n in sweep.variant_names[1:]  # not those skipped at every size
                 if any(run.variant(n).status == "ok" for run in sweep.runs)]
        for name in names:
            table.add_column(f"{name}\nx baseline", justify="right", no_wrap=True)
        for run in sweep.runs:
            table.add_row(str(run.config.n_layers), _min_med(run.variant("baseline"), stat, digits),
                          *[_ratios(run, name, low, mid) for name in names])
        tables.append(table)
    return tables


def print_sweep(sweep: SweepResult, *, console: Any = None) -> None:
    """Print :func:`to_sweep_tables` and each variant's notes, with the layer counts they hold for."""
    console = _console(console)
    for table in to_sweep_tables(sweep):
        _print_whole(console, table)
    notes: dict[tuple[str, str], list[int]] = {}
    for run in sweep.runs:
        for v in run.variants:
            if _notes(v):
                notes.setdefault((v.name, _notes(v)), []).append(run.config.n_layers)
    for line in _describe(sweep.runs[0], ",".join(map(str, sweep.layers))).split(" | "):
        _say(console, line)
    _say(console, _how(sweep.runs[0]))
    for (name, note), sizes in notes.items():
        _say(console, f"{name}: {note} (layers {', '.join(map(str, sizes))})")


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
