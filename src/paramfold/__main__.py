"""``paramfold`` and ``python -m paramfold``: the command line, with Ctrl-C said in one line from the start.

The console script calls :func:`main` here rather than :func:`paramfold.cli.main` so that an
interrupt while the CLI's own modules (typer, rich) are still being imported, or while typer
builds the command line, ends like any other interrupt, with one line and exit code 130, instead
of a traceback.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from paramfold.cli import main as run
    except KeyboardInterrupt:
        _interrupted()
    try:
        run(end_process=True)
    except KeyboardInterrupt:
        # Before the command's own handling is set up: while typer builds the command line from
        # the commands' signatures (the command, once it runs, says its signals itself).
        _interrupted()


def _interrupted() -> None:
    try:
        sys.stderr.write("paramfold: error: interrupted by SIGINT; no output was written\n")
    except (AttributeError, OSError, ValueError):
        pass
    sys.exit(130)


if __name__ == "__main__":
    main()
