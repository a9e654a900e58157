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


# --- recompiles ---------------------------------------------------------------------------------


@app.command(
    "recompiles",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def recompiles_command(
    command: list[str] = typer.Argument(
        ...,
        metavar="-- [python] SCRIPT [ARGS]... | -- [python] -m MODULE [ARGS]...",
        help="The script (or -m module) to run in this process, with its arguments.",
        show_default=False,
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the report as JSON on stdout (the script's own prints go to stderr).",
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Exit with code 3 if any function hit the recompile limit."
    ),
) -> None:
    """Run a Python script and report every torch.compile recompile: cause, category and fix.

    Example: paramfold recompiles -- python train.py --epochs 1
    """
    import contextlib
    import os
    import re
    import runpy
    import sys
    import traceback

    tokens = list(command)
    if tokens and (
        tokens[0] == sys.executable
        or re.fullmatch(r"python[\d.]*(\.exe)?", os.path.basename(tokens[0]))
    ):
        tokens = tokens[1:]
    if not tokens or (tokens[0] == "-m" and len(tokens) < 2):
        typer.echo(
            "paramfold recompiles: nothing to run; usage: "
            "paramfold recompiles -- python SCRIPT [ARGS]...",
            err=True,
        )
        raise typer.Exit(2)
    old_argv, old_path = sys.argv[:], sys.path[:]
    if tokens[0] == "-m":
        import importlib.util

        module = tokens[1]
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            sys.path[:] = old_path
            typer.echo(f"paramfold recompiles: no module named {module!r}", err=True)
            raise typer.Exit(2)
        argv0, rest = spec.origin or module, tokens[2:]
    else:
        module, argv0, rest = None, tokens[0], tokens[1:]
        if not os.path.isfile(argv0):
            typer.echo(f"paramfold recompiles: script not found: {argv0}", err=True)
            raise typer.Exit(2)

    from paramfold.recompiles import recompiles

    sys.argv = [argv0, *rest]
    if module is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv0)))
    redirect = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    code = 0
    try:
        with redirect, recompiles(warn=False) as report:
            try:
                if module is None:
                    runpy.run_path(argv0, run_name="__main__")
                else:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except KeyboardInterrupt:
                code = 130
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        report.print()
    if code == 0 and strict and report.limit_hit:
        code = 3
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
