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


@app.callback()
def _root() -> None:
    """Make torch.compile fast on parametrized models."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
