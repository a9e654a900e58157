"""What :func:`paramfold.recompiles` saw: the records, their counts, JSON and the rich tables.

:class:`CompileRecord` is one compile of one function, with its failed guards
(:class:`~paramfold.recompiles.classify.GuardFailure`); :class:`RecompileReport` holds them all and
renders them (``to_json()``, ``print()``, ``rich.print(report)``). Nothing here reads torch's trace;
:mod:`paramfold.recompiles.collect` fills the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from typing import Any

import torch

from paramfold.errors import counted
from paramfold.recompiles.classify import CATEGORIES, GuardFailure

__all__ = ["CompileRecord", "RecompileReport", "short_path"]



@dataclasses.dataclass
class CompileRecord:
    """One compile of one function (a first compile, a recompile, or a refused one: limit hit)."""

    compile_id: str
    function: str
    filename: str
    lineno: int | None
    kind: str  # "first compile" | "recompile" | "limit hit"
    failed_guards: list[GuardFailure]
    graphs: int  # FX graphs dynamo produced in this compile
    dynamic: list[str]  # sizes that became symbolic (dynamic) in this compile, e.g. "x.size()[1]"
    graph_breaks: list[str] = dataclasses.field(default_factory=list)  # "at file:line: reason"
    limit_type: str | None = None
    limit: int | None = None
    fix: str | None = None  # for "limit hit"
    fail_type: str | None = None
    fail_reason: str | None = None
    # "torch._dynamo.external_utils.wrap_inline" when the compiled code object is torch's shared
    # wrapper around a callable dynamo would not trace itself, "paramfold.classes._root_forward"
    # when it is paramfold's frame for a prepared root whose forward is torch's own (one per such
    # forward); ``function`` then names the callable or forward the wrapper runs.
    shared_code: str | None = None

    @property
    def location(self) -> str:
        """``name (file:line)``, the key used by :meth:`RecompileReport.graphs_per_function`."""
        return f"{self.function} ({short_path(self.filename)}:{self.lineno})"

    @property
    def cause(self) -> str | None:
        """Category of the guard torch names first (its ``recompile_reason``), or ``limit hit``.

        That guard is the newest cached graph's: where the cached graphs failed on guards of
        several categories, :attr:`categories` has them all (the per-function summary shows them
        all, ``shape or grad_mode``)."""
        if self.kind == "limit hit":
            return "limit hit"
        if self.kind != "recompile":
            return None
        return self.failed_guards[0].category if self.failed_guards else "other"

    @property
    def failed(self) -> bool:
        """Whether the compile failed (``fail_type``: a backend that raised, an error in dynamo),
        other than by being refused at the recompile limit (``kind`` says that): it made no graph
        that torch keeps, and the call ran uncompiled or raised."""
        return self.kind != "limit hit" and (self.fail_type is not None or self.fail_reason is not None)

    @property
    def categories(self) -> list[str]:
        """The categories of the failed guards (and ``limit hit``), in :data:`CATEGORIES` order."""
        found = {g.category for g in self.failed_guards}
        if self.kind == "limit hit":
            found.add("limit hit")
        return [c for c in CATEGORIES if c in found]


class RecompileReport:
    """What :func:`recompiles` saw: ``.records``, counts, ``.to_json()``, ``.print()``.

    Also a rich renderable: ``rich.print(report)``.
    """

    def __init__(self) -> None:
        self.records: list[CompileRecord] = []
        self.graphs_total = 0  # counters["stats"]["unique_graphs"] delta over the block
        # graph breaks dynamo logged in the block (dynamo_graph_break_reason); None where torch logs
        # no such event (< 2.6: recompiles() sets it)
        self.graph_breaks: int | None = 0
        self.collection_errors: list[str] = []

    @property
    def recompiles(self) -> list[CompileRecord]:
        return [r for r in self.records if r.kind == "recompile"]

    @property
    def limit_hits(self) -> list[CompileRecord]:
        return [r for r in self.records if r.kind == "limit hit"]

    @property
    def limit_hit(self) -> bool:
        return bool(self.limit_hits)

    def graphs_per_function(self) -> dict[str, int]:
        """Graphs made per compiled function, keyed ``"name (file:line)"``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.location] = out.get(r.location, 0) + r.graphs
        return out

    def recompiles_per_function(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.recompiles:
            out[r.location] = out.get(r.location, 0) + 1
        return out

    def causes(self) -> dict[str, int]:
        """Recompiles (and limit hits) per cause, in :data:`CATEGORIES` order."""
        c = Counter(r.cause for r in self.records if r.cause)
        return {k: c[k] for k in CATEGORIES if c[k]}

    def to_dict(self) -> dict[str, Any]:
        functions = []
        for loc, graphs in self.graphs_per_function().items():
            recs = [r for r in self.records if r.location == loc]
            functions.append(
                {
                    "function": recs[0].function,
                    "filename": recs[0].filename,
                    "lineno": recs[0].lineno,
                    "graphs": graphs,
                    "recompiles": sum(r.kind == "recompile" for r in recs),
                    "limit_hit": any(r.kind == "limit hit" for r in recs),
                    "causes": dict(Counter(r.cause for r in recs if r.cause)),
                }
            )
        return {
            "torch_version": torch.__version__,
            "graphs": self.graphs_total,
            "graph_breaks": self.graph_breaks,
            "compiles": len(self.records),
            "failed_compiles": sum(r.failed for r in self.records),
            "recompiles": len(self.recompiles),
            "limit_hit": self.limit_hit,
            "causes": self.causes(),
            "functions": functions,
            "records": [
                {**dataclasses.asdict(r), "cause": r.cause, "categories": r.categories, "failed": r.failed}
                for r in self.records
            ],
            "collection_errors": self.collection_errors,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON (``limit_hit`` is a top-level flag)."""
        return json.dumps(self.to_dict(), indent=indent)

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        recs_per = self.recompiles_per_function()
        for loc, graphs in self.graphs_per_function().items():
            # titles on lines of their own, as audit's header: a table pads its title to its width
            parts.append(Text(f"{loc}: {counted(graphs, 'graph')}, {counted(recs_per.get(loc, 0), 'recompile')}",
                              style="table.title"))
            table = Table(expand=False)
            for col, kw in (
                ("id", {"no_wrap": True}),
                ("event", {}),
                ("failed guard (cached graph: check)", {"overflow": "fold", "ratio": 1}),
                ("category", {"no_wrap": True}),
                ("fix", {"overflow": "fold", "ratio": 1}),
            ):
                table.add_column(col, **kw)
            for r in self.records:
                if r.location == loc:
                    self._add_rows(table, r)
            parts.append(table)

        parts.append(Text("per function", style="table.title"))
        summary = Table()
        for col in ("function", "graphs", "recompiles", "causes of recompiles"):
            summary.add_column(col)
        for loc, graphs in self.graphs_per_function().items():
            causes = Counter(_all_causes(r) for r in self.records if r.location == loc and r.cause)
            summary.add_row(
                loc, str(graphs), str(recs_per.get(loc, 0)),
                ", ".join(f"{k} x{n}" for k, n in sorted(causes.items(), key=_cause_order)) or "-",
            )
        parts.append(summary)
        breaks = (
            counted(self.graph_breaks, "graph break") if self.graph_breaks is not None
            else "graph breaks and dynamic dims not reported by torch < 2.6"
        )
        n_failed = sum(r.failed for r in self.records)
        failed = f" ({n_failed} failed: no graph)" if n_failed else ""
        parts.append(
            Text(
                f"{counted(self.graphs_total, 'graph')}, {counted(len(self.recompiles), 'recompile')}, {breaks} in "
                f"{counted(len(self.records), 'compile')}{failed} (torch {torch.__version__})"
            )
        )
        shared = sorted({r.location for r in self.records if r.shared_code})
        if shared:
            codes = ", ".join(sorted({r.shared_code for r in self.records if r.shared_code}))
            parts.append(
                Text(
                    f"{', '.join(shared)}: compiled through one shared wrapper code object "
                    f"({codes}); all of them count against one recompile limit",
                    style="yellow",
                )
            )
        for r in self.limit_hits:
            parts.append(Text(f"RECOMPILE LIMIT HIT: {r.fix}", style="bold red"))
        for err in self.collection_errors:
            parts.append(Text(f"paramfold could not read a torch trace event: {err}", style="red"))
        return Group(*parts)

    @staticmethod
    def _add_rows(table: Any, r: CompileRecord) -> None:
        from rich.text import Text

        event = r.kind
        if r.failed:  # torch gave up on it: the function runs uncompiled (or the error was raised)
            event += f"\nFAILED: {r.fail_type or 'error'}"
            if r.fail_reason:
                reason = " ".join(r.fail_reason.split())
                event += f": {reason[:157] + '...' if len(reason) > 160 else reason}"
        elif r.graphs == 0 and r.kind == "first compile":
            event += " (no graph)"
        if r.dynamic:
            event += "\ndynamic: " + ", ".join(r.dynamic)
        for b in r.graph_breaks:
            event += f"\ngraph break {b}"
        style = "bold red" if r.kind == "limit hit" or r.failed else ("yellow" if r.kind == "recompile" else "")
        # One row per distinct failed check, prefixed by the cached graphs it failed on.
        grouped: dict[tuple[str, str, str], list[str]] = {}
        for g in r.failed_guards:
            grouped.setdefault((g.guard, g.category, g.fix), []).append(g.cached_compile_id)
        rows = [
            (f"{', '.join(ids)}: {guard}", cat, fix) for (guard, cat, fix), ids in grouped.items()
        ]
        if r.kind == "limit hit":
            rows.append(("", "limit hit", r.fix or ""))
        if not rows:
            rows = [("-", "", "")]
        seen: set[tuple[str, str]] = set()
        for i, (guard, cat, fix) in enumerate(rows):
            table.add_row(
                r.compile_id if i == 0 else "",
                Text(event, style=style) if i == 0 else "",
                guard,
                Text(cat, style="bold red" if cat == "limit hit" else ""),
                "same as above" if (cat, fix) in seen else fix,
                end_section=i == len(rows) - 1,
            )
            seen.add((cat, fix))

    def print(self, console: Any = None) -> None:
        """Print the tables (to stdout, or to the given ``rich.console.Console``)."""
        from paramfold.terminal import stdout_console

        console = console or stdout_console(160)
        console.print(self)

    def __repr__(self) -> str:
        return (
            f"RecompileReport(compiles={len(self.records)}, graphs={self.graphs_total}, "
            f"recompiles={len(self.recompiles)}, limit_hit={self.limit_hit})"
        )


def _all_causes(r: CompileRecord) -> str:
    """A recompile in the per-function summary: the categories of all its failed guards, joined
    by "or" (``shape or grad_mode``). Each cached graph failed on a guard of its own, and which
    graph the call "should" have reused is not torch's to say: the newest one alone
    (``CompileRecord.cause``) could be a no_grad graph, called "unavoidable", where an older one
    differs in a stride that can be fixed."""
    if r.kind != "recompile":
        return r.cause or ""
    return " or ".join(r.categories) or "other"


def _cause_order(item: tuple[str, int]) -> list[int]:
    return [CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES) for c in item[0].split(" or ")]


def short_path(path: str) -> str:
    """A file of an installed package or the standard library as imported
    (``torch/nn/modules/container.py``, also from a venv inside the working directory); else
    relative to the working directory when it lies below it; else as it is."""
    real = os.path.realpath(path)
    for root in _import_roots():
        rel = _below(real, root)
        if rel is not None:
            return rel
    rel = _below(path, os.getcwd())
    return path if rel is None else rel


def _below(path: str, root: str) -> str | None:
    try:
        rel = os.path.relpath(path, root)
    except ValueError:  # another drive
        return None
    return None if rel == os.curdir or rel.startswith(os.pardir) else rel


def _import_roots() -> list[str]:
    """The directories of ``sys.path`` that hold installed packages and the standard library,
    deepest first (a venv's site-packages lies below the stdlib's prefix on some layouts)."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths}
    roots |= {os.path.realpath(p) for p in sys.path if p and os.path.basename(p) in ("site-packages", "dist-packages")}
    return sorted(roots, key=len, reverse=True)
