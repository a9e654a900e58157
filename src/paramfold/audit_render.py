"""How the command line shows a checkpoint audit: the rich table, the summary line, byte sizes.

Kept apart from :mod:`paramfold.audit` and :mod:`paramfold.fold`, which compute and return plain
data (``AuditReport.to_json()`` is the machine-readable form); rich is imported only when printing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paramfold.errors import counted

if TYPE_CHECKING:
    from rich.console import Console

    from paramfold.audit import AuditReport
    from paramfold.checkpoint import TensorInfo

__all__ = ["human_bytes", "print_report"]


def print_report(report: AuditReport, console: Console | None = None) -> None:
    """Print ``report``: a header (the file read, its format, the entry the weights were under), a
    rich table of the sites where there are any, and a summary line."""
    from rich.table import Table

    from paramfold.terminal import stdout_console

    console = console or stdout_console(200)
    root = f" (under '{report.root}')" if report.root else ""
    if report.beside:  # a model whose weights are all scalars would be one of them: say it was not read
        names = ", ".join(f"'{k}'" for k in report.beside[:4]) + (", ..." if len(report.beside) > 4 else "")
        root = f" (under '{report.root}'; {names}: scalar tensors only, taken as metadata)"
    title = _shown(f"{report.path} [{report.format}]{root}")
    table = Table()
    table.add_column("module", overflow="fold")
    table.add_column("tensor")
    table.add_column("kind")
    table.add_column("originals", overflow="fold")
    table.add_column("stored", justify="right")
    table.add_column("folded", justify="right")
    styles = {"custom": "red", "orthogonal": "yellow", "torchao_subclass": "yellow"}
    for s in report.sites:
        pieces = [f"{n} {_shape(i)} {i.dtype_name}" for n, i in {**s.originals, **s.state}.items()]
        kind = s.kind + (f" dim={s.params['dim']}" if s.params.get("dim") is not None else "")
        table.add_row(
            _shown(s.module or "(root)"),
            _shown(s.tensor),
            f"[{styles.get(s.kind, 'green')}]{kind}[/]",
            "\n".join(map(_shown, pieces)),
            human_bytes(s.originals_bytes + s.state_bytes),
            "?" if s.folded_bytes is None else human_bytes(s.folded_bytes),
        )
    # The header on a line of its own, as a table would title it, but a path kept whole and not
    # padded to the table's width.
    console.print(title, style="table.title", highlight=False, soft_wrap=True)
    if report.sites:
        console.print(table)
    kinds = ", ".join(f"{k} {n}" for k, n in report.kinds.items()) or "none"
    stored = sum(s.originals_bytes + s.state_bytes for s in report.sites)
    folded = sum(s.folded_bytes or 0 for s in report.sites)
    unknown = sum(s.folded_bytes is None for s in report.sites)
    refused = len(report.refused)
    by_data = sum(s.decided_by_data for s in report.sites)
    n = len(report.sites)
    if unknown == n and n:
        folded_text = "?"
    else:
        folded_text = human_bytes(folded) + (f" + {unknown} unknown" if unknown else "")
    console.print(
        f"{counted(n, 'parametrized site')} ({kinds}); stored {human_bytes(stored)} -> folded "
        f"{folded_text}; {counted(report.plain_tensors, 'plain tensor')} ({human_bytes(report.plain_bytes)}); "
        + (f"{refused} need --model to fold" if refused else "foldable from keys alone" + (
            f" if the stored tensors settle the dim of {counted(by_data, 'site')} "
            "(fold reads them and otherwise refuses: then pass --model)" if by_data else "")),
        highlight=False, soft_wrap=True,
    )


def _shown(text: str) -> str:
    """``text`` for the table: rich markup escaped, control characters written out (``printable``)."""
    from rich.markup import escape

    from paramfold.terminal import printable

    return escape(printable(text))


def _shape(i: TensorInfo) -> str:
    return "[" + ",".join(map(str, i.shape)) + "]"


def human_bytes(n: int) -> str:
    """A byte count as the audit table and the fold summary print it.

    Example::

        >>> human_bytes(512), human_bytes(2_726_297)
        ('512 B', '2.6 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
