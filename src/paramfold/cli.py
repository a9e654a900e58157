"""The ``paramfold`` command line: ``bench``, ``audit`` and ``recompiles``."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="paramfold",
    help="Make torch.compile fast on parametrized models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
