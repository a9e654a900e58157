"""The ``paramfold`` command line: ``bench``, ``audit`` and ``recompiles``."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(
    name="paramfold",
    help="Make torch.compile fast on parametrized models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# --- bench -------------------------------------------------------------------------------------


@app.command("bench")
def bench(
    model: str = typer.Option("seed", help="seed, weight_norm, spectral_norm or orthogonal."),
    layers: int | None = typer.Option(None, help="Number of layers [default: per model]."),
    width: int | None = typer.Option(None, help="Layer width [default: per model]."),
    backend: str = typer.Option("eager", help="torch.compile backend: eager, aot_eager, inductor."),
    entry: str = typer.Option(
        "model",
        help="How to compile: model = torch.compile(model), method = model.compile(), "
        "layers = .compile() on each layer of model.seq.",
    ),
    train: bool = typer.Option(
        False, "--train/--eval", help="One training step (forward+backward) or a no_grad forward."
    ),
    repeats: int = typer.Option(3, help="Measurements per variant (min and median reported)."),
    threads: int = typer.Option(
        1, help="torch.set_num_threads for the run; 0 leaves torch's setting."
    ),
    device: str = typer.Option("cpu", help="Where the model runs: cpu, cuda, cuda:1, ..."),
    variant: list[str] | None = typer.Option(
        None, "--variant", help="Measure only these (repeatable); baseline and stock always run."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON document with every sample."),
    plot: str | None = typer.Option(
        None, metavar="PNG", help="Also write a bar chart of the ratios to this PNG file."
    ),
) -> None:
    """Time the first compiled call of baseline, stock and each paramfold mode, side by side."""
    import json
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from paramfold.bench import BenchConfig, run_bench, to_rich_table

    err = Console(stderr=True)

    def fail(message: str, code: int = 1) -> None:
        err.print(f"paramfold bench: error: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    try:
        config = BenchConfig(
            model=model, layers=layers, width=width, backend=backend, entry=entry, train=train,
            repeats=repeats, threads=threads or None, variants=tuple(variant) if variant else None,
            device=device,
        )
        config.check_device()
    except ValueError as exc:
        fail(str(exc), code=2)
    if plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(plot))):
        fail(f"cannot write {plot}: its folder does not exist", code=2)

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def on_progress(done: int, total: int, label: str) -> None:
            progress.update(task, completed=done, total=total, description=label)

        try:
            result = run_bench(config, on_progress=on_progress)
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        out = Console()
        if not out.is_terminal:
            out = Console(width=200)  # piped into a file or README: do not wrap the table
        out.print(to_rich_table(result))
    if plot is not None:
        from paramfold.plot import plot_ratios

        try:
            plot_ratios(result, plot)
        except (ImportError, OSError) as exc:
            fail(str(exc))
    failed = [v for v in result.variants if v.status == "error"]
    if failed:
        fail("variant(s) failed: " + "; ".join(f"{v.name}: {v.note.splitlines()[0]}" for v in failed))


# --- end bench ---------------------------------------------------------------------------------


@app.callback()
def _root() -> None:
    """Make torch.compile fast on parametrized models."""


# --- paramfold audit ------------------------------------------------------------------------------


@app.command("audit")
def audit(
    path: str = typer.Argument(
        ..., help="A .pt/.pth/.bin/.ckpt or .safetensors file, a *.safetensors.index.json, or a folder holding one."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as a JSON document instead of a table."),
    fold_out: Optional[str] = typer.Option(
        None, "--fold-out", metavar="OUT", help="Write the unparametrized model's checkpoint here (.safetensors or .pt)."
    ),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        metavar="MODULE:FACTORY",
        help="With --fold-out: build the parametrized model with FACTORY() from MODULE (a dotted module or a "
        "path to a .py file), load the checkpoint into it and materialise every parametrization. "
        "Needed for kinds that cannot be folded from the checkpoint alone.",
    ),
) -> None:
    """Inspect a checkpoint for parametrizations without running its pickle; optionally fold it.

    Example: paramfold audit vocoder.pt --fold-out vocoder_plain.safetensors
    """
    import sys

    from paramfold.checkpoint import CheckpointError

    try:
        if model is not None and fold_out is None:
            raise CheckpointError("--model only applies together with --fold-out OUT", exit_code=2)
        from paramfold.audit import audit_checkpoint, fold_checkpoint, print_report

        report = audit_checkpoint(path)
        if json_out:
            typer.echo(report.to_json())
        else:
            print_report(report)
        if fold_out is not None:
            res = fold_checkpoint(path, fold_out, model_factory=model)
            typer.echo(res.summary(), err=json_out)
    except CheckpointError as e:
        print(f"paramfold audit: error: {e}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None


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
            "paramfold recompiles: error: nothing to run; usage: "
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
            typer.echo(f"paramfold recompiles: error: no module named {module!r}", err=True)
            raise typer.Exit(2)
        argv0, rest = spec.origin or module, tokens[2:]
    else:
        module, argv0, rest = None, tokens[0], tokens[1:]
        if not os.path.isfile(argv0):
            typer.echo(f"paramfold recompiles: error: script not found: {argv0}", err=True)
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
