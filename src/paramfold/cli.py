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


# --- bench -------------------------------------------------------------------------------------


# A callback keeps `paramfold bench` a subcommand even while it is the app's only command.
@app.callback()
def _group() -> None:
    pass


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
        err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    try:
        config = BenchConfig(
            model=model, layers=layers, width=width, backend=backend, entry=entry, train=train,
            repeats=repeats, threads=threads or None, variants=tuple(variant) if variant else None,
        )
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
