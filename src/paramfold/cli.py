"""The ``paramfold`` command line: ``bench``, ``audit``, ``fold`` and ``recompiles``.

Every failure ends with one line on stderr, ``paramfold <command>: error: <what, and what to do>``
(``paramfold: error: ...`` when no command was named), printed by :func:`_say` and nowhere else;
commands raise, and :func:`_guarded` turns the exception into that line and one of these exit codes:

===== ==========================================================================================
0     success
1     the work failed: a file's contents (corrupt, truncated, a refused pickle, tensors that do
      not fit together), the environment (disk full, permission denied, out of memory), a bench
      variant that failed, or an unexpected error
2     the command line: an unknown option or value, a missing input, an unsupported format, an
      output path that cannot be used (missing folder, read-only, a FIFO or device, the input
      itself), nothing to run
3     ``recompiles --strict``: a function hit dynamo's recompile limit (a failed script's own
      status wins, the hit still said)
129   interrupted by SIGHUP, 130 by SIGINT (Ctrl-C), 143 by SIGTERM (``timeout``, schedulers)
===== ==========================================================================================

``recompiles -- python script.py`` otherwise exits with the script's own status; what the script
prints, its traceback included, is its own output. A stdout closed early (``| head``) is no
failure: the command runs to its end with what it prints dropped
(:func:`paramfold.terminal.stdout_quiet_when_closed`), and exits with its own code. Outputs are written whole or not at all
(:mod:`paramfold.output`): after a failure or a signal no partial or temporary file is left and a
pre-existing output file is unchanged. ``--debug`` (before the command: ``paramfold --debug audit
...``) or ``PARAMFOLD_DEBUG=1`` also prints the traceback.

This module imports neither torch nor the rest of paramfold until a command runs, so ``--help``
and ``--version`` answer at once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Any, Callable, Literal, NoReturn, Optional, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.22 vendors click
    from typer import _click as click
except ImportError:  # pragma: no cover - older typer
    import click  # type: ignore[no-redef]

from paramfold import __version__

F = TypeVar("F", bound=Callable[..., Any])

# The choices of `paramfold bench`; test_cli checks them against paramfold.bench (which imports torch).
MODEL_NAMES = ("seed", "weight_norm", "spectral_norm", "weight_norm_hooks", "spectral_norm_hooks", "orthogonal")
BACKEND_NAMES = ("eager", "aot_eager", "inductor")
ENTRY_NAMES = ("model", "method", "layers")
VARIANT_NAMES = ("baseline", "stock", "hoist", "inline", "freeze", "auto")
VariantName = Enum("VariantName", {n: n for n in VARIANT_NAMES}, type=str)  # type: ignore[misc]
# The ranges of bench's integer options, for --help: a copy of paramfold.bench.config.LIMITS (which
# checks them), test_cli checks the two agree.
BENCH_LIMITS = {"layers": (1, 10_000), "width": (2, 16_384), "repeats": (1, 1_000), "steady_rounds": (1, 1_000),
                "threads": (1, 1_024)}


def _range(name: str) -> str:
    low, high = BENCH_LIMITS[name]
    return f"{low} to {high}"


def _integer(value: Any) -> int:
    """An integer option's value: digits, perhaps signed (its range is checked later); typer's
    parsing (pydantic's) would also take ``1_0`` and ``5.0``, as ``int()`` takes ``1_0``."""
    import re
    import reprlib

    if isinstance(value, int):  # the default
        return value
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"{reprlib.repr(value)} is not an integer (digits only, e.g. 16)")
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        raise ValueError(f"a number of {len(text)} digits is far too large") from None


def _debug() -> bool:
    """``paramfold --debug ...`` or ``PARAMFOLD_DEBUG=1``: print the traceback of a failure too."""
    ctx = click.globals.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().params.get("debug"):
        return True  # read from the command line, not set in os.environ: nothing outlives this call
    return os.environ.get("PARAMFOLD_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _say(command: str, message: str) -> None:
    """The one way this CLI prints an error: ``paramfold <command>: error: <message>``, one line.

    ``command`` is ``""`` for an error of the root command (no command named, or none yet).
    """
    from paramfold.terminal import printable

    # One line, whatever the message held: a control character is written out (a path's newline as
    # \n), as the success lines show it, never turned into a space that names another file; the
    # line breaks of another library's message are made spaces where it is quoted (errors.one_line).
    text = printable(str(message))
    _said[:] = [True]
    try:
        sys.stderr.write(f"paramfold{' ' + command if command else ''}: error: {text}\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed (None at start-up) or failing: the exit code says it
        pass


#: Whether ``recompiles``' script has ended (run to its end or interrupted) and its report is being
#: made: an interrupt then leaves the report of what ran before it, before that nothing at all.
_reporting: list[bool] = []
#: The output a command has completed (renamed into place), for a failure or signal after it.
_written: list[str] = []
#: The command that ran (its _guarded name), whether an error line was said and whether the
#: command has ended (its output complete): for a signal after the command has ended.
_ran: list[str] = []
_said: list[bool] = []
_ended: list[bool] = []
#: Whether the process ends when the command line does (``standalone_mode``, click's promise that
#: ``main`` never returns): ``recompiles`` then runs Python's exit steps for its script itself.
_standalone: list[bool] = []


def _describe(exc: BaseException, command: str = "") -> tuple[int, str]:
    """The exit code and the one-line message for an exception that ends a command."""
    from paramfold.errors import FoldError, one_line
    from paramfold.output import describe_os_error
    from paramfold.signals import Interrupted, from_signal

    if isinstance(exc, KeyboardInterrupt) and from_signal(exc):
        signame = exc.args[0] if isinstance(exc, Interrupted) else "SIGINT"
        code = exc.exit_code if isinstance(exc, Interrupted) else 130
        if _written:
            after = f"{_written[0]} was written whole before it"
        elif _ended:  # while the process exits
            after = "the command had completed before it, its output whole"
        elif command == "recompiles" and _reporting:
            after = "the report covers what ran before it"
        elif command == "recompiles":  # still starting: the script had not run, nothing was printed
            after = "the script had not started: no report was printed"
        else:  # nothing: outputs are written whole or not at all
            after = "no output was written"
        return code, f"interrupted by {signame}; {after}"
    if isinstance(exc, FoldError):
        return getattr(exc, "exit_code", 1), str(exc)
    if isinstance(exc, MemoryError):
        return 1, "out of memory" + (f": {one_line(str(exc))}" if str(exc) else "")
    if isinstance(exc, OSError):
        if _written:  # printing the summary failed (stdout on a full disk): the output is whole
            return 1, f"{_written[0]} was written whole, then printing its summary failed: {exc.strerror or exc}"
        return 1, describe_os_error(exc)
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
        return code or 1, f"exited early (sys.exit({exc.code!r}))"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, RuntimeError) and "alloc" in text.lower() and "memory" in text.lower():
        return 1, f"out of memory: {text}"
    if isinstance(exc, KeyboardInterrupt):  # raised by code (from_signal): a failure like any other
        text = f"raised without a signal{': ' + text if text else ''}"
    return 1, f"{type(exc).__name__}: {text} (unexpected; PARAMFOLD_DEBUG=1 shows the traceback)"


def _guarded(command: str) -> Callable[[F], F]:
    """Turn every exception out of a command into one stderr line and an exit code."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from paramfold.signals import Interrupted, raise_if_interrupted, signal_arrived

            _ran[:] = [command]
            try:
                rv = fn(*args, **kwargs)
                raise_if_interrupted()  # a signal whose exception something caught and dropped
                return rv
            except (typer.Exit, typer.Abort, click.exceptions.ClickException):
                raise  # usage errors: one line from _Group.main
            except BaseException as exc:  # noqa: BLE001 - the CLI's one exit point for failures
                signum = signal_arrived()
                if signum is not None and not isinstance(exc, KeyboardInterrupt):
                    exc = Interrupted(signum)  # the failure followed a signal whose exception was dropped
                code, message = _describe(exc, command)
                if _debug():
                    import traceback

                    traceback.print_exc()
                _say(command, message)
                raise typer.Exit(code) from None

        return wrapper  # type: ignore[return-value]

    return decorate


@contextlib.contextmanager
def _interrupt_said() -> Iterator[None]:
    """Say an interrupt in the block (outside any _guarded command) and exit with its code."""
    try:
        yield
    except KeyboardInterrupt as e:
        code, message = _describe(e)
        _say("", message)
        raise typer.Exit(code) from None


class _PlainHelpFlag:
    """Help shows ``-h, --help`` without a ``<bool>`` type (flags here all have ``metavar=""``)."""

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)  # type: ignore[misc]
        if opt is not None:
            opt.metavar = ""
        return opt


class _Command(_PlainHelpFlag, TyperCommand):
    """A subcommand."""


class _Group(_PlainHelpFlag, TyperGroup):
    """The root command: one-line usage errors, signals turned into exceptions, an exit code."""

    # typer turns a KeyboardInterrupt (and so any handled signal) out of parsing or invoking into a
    # silent exit 130; outside a command (whose own are _guarded) it is said here, with its code.
    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _interrupt_said():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _interrupt_said():
            return super().invoke(ctx)

    def main(self, args: Any = None, prog_name: Optional[str] = None, complete_var: Optional[str] = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Run the command line; ``end_process=True`` (the console script) also ends the process
        (:func:`_end_process`) with handled signals still said as documented until the end."""
        from paramfold.signals import signals_raise
        from paramfold.terminal import stdout_quiet_when_closed

        end_process = extra.pop("end_process", False)
        columns = os.environ.get("COLUMNS")
        if columns is not None and not (columns.isdigit() and int(columns) > 0):
            # rich takes COLUMNS=0 for a width of 0 and prints nothing at all, and ignores " 90": no width is the terminal's
            del os.environ["COLUMNS"]
        _written.clear()  # a command called in the same process before this one wrote it, not this one
        _ran.clear()
        _said.clear()
        _ended.clear()
        _reporting.clear()
        _standalone[:] = [standalone_mode]
        with signals_raise(), stdout_quiet_when_closed():
            try:
                code = self._run_command(args, prog_name, complete_var, **extra)
                _ended[:] = [True]
            except KeyboardInterrupt as e:  # a signal while an error was being said
                code = _signal_after(e, 0)
            if standalone_mode and end_process and _ran != ["recompiles"]:
                try:
                    _end_process(code)
                except KeyboardInterrupt as e:  # before _end_process took the signals over
                    _end_process(_signal_after(e, code))
        if standalone_mode:
            sys.exit(code)
        return code

    def _run_command(self, args: Any, prog_name: Optional[str], complete_var: Optional[str], **extra: Any) -> int:
        """Parse and invoke; every outcome becomes an exit code (and the one error line)."""
        try:
            rv = super().main(args=args, prog_name=prog_name or "paramfold", complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.NoArgsIsHelpError as e:
            # The help, once: building the error formatted it (rich prints it there and the
            # message is empty; click's plain formatter returns it as the message).
            message = e.format_message()
            if message:
                typer.echo(message)
            _say("", f"no command given: name one of {', '.join(self.commands)} (paramfold <command> --help)")
            code = 2
        except click.exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self._command_named(args)
            # typer's choice coercion words a bad choice as "Value error, 'x' is not one of ...".
            message = e.format_message().replace(": Value error, ", ": ")
            _say(where.partition(" ")[2], f"{message} (see {where} --help)")
            code = 2
        except click.exceptions.ClickException as e:
            _say("", e.format_message())
            code = e.exit_code
        except typer.Abort:
            _say("", "aborted")
            code = 1
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except OSError as e:  # printing help or the version to a full disk
            from paramfold.output import describe_os_error

            _say("", describe_os_error(e))
            code = 1
        except KeyboardInterrupt as e:  # a signal before or after click's own handling
            code, message = _describe(e)
            _say("", message)
        return code


    def _command_named(self, args: Any) -> str:
        """``paramfold <command>`` for the command the arguments name (after any root options),
        for a usage error raised without a context (``--json=1``: an option given a value)."""
        for arg in sys.argv[1:] if args is None else args:
            if arg in self.commands:
                return f"paramfold {arg}"
            if not arg.startswith("-"):
                break
        return "paramfold"


def _signal_after(exc: KeyboardInterrupt, code: int) -> int:
    """The exit code for a signal once the command has ended with ``code``: said as documented
    (``...; OUT was written whole before it``), unless an error line was said already (one line)."""
    if _said:
        return code
    command = _ran[0] if _ran else ""
    new_code, message = _describe(exc, command)
    _say(command, message)
    return new_code


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # None, closed or failing
            stream.flush()


def _end_process(code: int) -> NoReturn:
    """End the process with ``code``, a handled signal said as documented until the very end.

    Python puts the default handlers back when it shuts down, before it tears down the modules
    (torch's take a few tenths of a second): a SIGTERM then killed the process without a word,
    exit 143, though the command had ended and OUT was whole. So the exit is done here, as
    Python's own exit does it (threading's exit hooks, other threads joined, the ``atexit``
    functions), with a handled signal now saying ``interrupted by SIGTERM; OUT was written whole
    before it`` (or ``the command had completed before it, its output whole``) and exiting with its
    code, then the process ends with ``os._exit``, without the teardown. ``recompiles`` is not
    ended this way: the script it ran keeps a normal exit.
    After a failure (its line said) a signal ends the process with the failure's code.
    """
    from paramfold.signals import Interrupted, on_signal_instead, python_exit_steps

    def late(signum: int) -> None:
        exit_code = _signal_after(Interrupted(signum), code)
        _flush()
        os._exit(exit_code)

    on_signal_instead(late)
    python_exit_steps()
    _flush()
    os._exit(code)


app = typer.Typer(
    name="paramfold",
    cls=_Group,
    help="Make torch.compile fast on parametrized models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"paramfold {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, metavar="",
        help="Print paramfold's version and exit.",
    ),
    debug: bool = typer.Option(
        False, "--debug", metavar="",
        help="On a failure, also print the traceback (or set PARAMFOLD_DEBUG=1).",
    ),
) -> None:
    """Make torch.compile fast on parametrized models.

    Exit codes: 0 ok, 1 the work failed (file contents, disk, memory), 2 bad command line,
    3 recompiles --strict hit the recompile limit, 129/130/143 interrupted by SIGHUP/SIGINT/SIGTERM.
    """
    # --debug is read back by _debug() from this context's params.


# --- bench -------------------------------------------------------------------------------------


@app.command("bench", cls=_Command)
@_guarded("bench")
def bench(
    model: Literal["seed", "weight_norm", "spectral_norm", "weight_norm_hooks", "spectral_norm_hooks", "orthogonal"] = typer.Option(
        "seed", metavar="NAME",
        help="The parametrized model of the zoo to measure: seed, weight_norm, spectral_norm, weight_norm_hooks, spectral_norm_hooks (torch's deprecated hook-based norms) or orthogonal."
    ),
    layers: Optional[int] = typer.Option(
        None, parser=_integer, help=f"Number of layers, {_range('layers')} \\[default: 32 for seed, else 16]."
    ),
    width: Optional[int] = typer.Option(
        None, parser=_integer, help=f"Layer width, {_range('width')} \\[default: 128 for seed and weight_norm, else 64]."
    ),
    backend: Literal["eager", "aot_eager", "inductor"] = typer.Option(
        "eager", metavar="NAME", help="The torch.compile backend: eager, aot_eager or inductor."
    ),
    entry: Literal["model", "method", "layers"] = typer.Option(
        "model", metavar="NAME",
        help="How to compile: model = torch.compile(model), method = model.compile(), "
        "layers = .compile() on each layer of model.seq.",
    ),
    train: bool = typer.Option(
        False, "--train/--eval", metavar="",
        help="One training step (forward+backward) or a no_grad forward.",
    ),
    grad: bool = typer.Option(
        False, "--grad", metavar="",
        help="A forward in training mode that records autograd, with no backward (freeze is skipped). Instead of --train.",
    ),
    repeats: int = typer.Option(
        3, parser=_integer, help=f"First compiled calls per variant, {_range('repeats')} (min and median reported)."
    ),
    steady_rounds: int = typer.Option(
        5, "--steady-rounds", parser=_integer,
        help=f"Interleaved rounds of 10 steady calls (or training steps) per variant, {_range('steady_rounds')} (min and median reported)."
    ),
    sweep_layers: Optional[str] = typer.Option(
        None, "--sweep-layers", metavar="N,N,...",
        help=f"Run once per layer count (e.g. 32,128,512; each {_range('layers')}): how the first call and the steady time grow with model size. Instead of --layers.",
    ),
    threads: int = typer.Option(
        1, parser=_integer, help=f"torch.set_num_threads for the run, {_range('threads')}; 0 leaves torch's setting."
    ),
    device: str = typer.Option("cpu", help="Where the model runs: cpu, cuda, cuda:1, ..."),
    variant: Optional[list[VariantName]] = typer.Option(  # type: ignore[valid-type]
        None, "--variant", metavar="NAME",
        help="Measure only this variant: hoist, inline, freeze or auto (repeat the option for "
        "several); baseline and stock always run. \\[default: all]",
    ),
    wide: bool = typer.Option(
        False, "--wide", metavar="",
        help="Show every column (CPU time, steady ms, prepare time, notes) in the table; it needs ~150 columns. Not with --sweep-layers.",
    ),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print a JSON document with every sample."),
    plot: Optional[str] = typer.Option(
        None, metavar="PNG",
        help="Also write a figure to this PNG file: the ratios, or with --sweep-layers the times against the layer count.",
    ),
) -> None:
    """Time the first compiled call and the steady call of each paramfold mode, as ratios to the plain model.

    Side by side: baseline (the plain model), stock (the parametrized one) and each paramfold mode;
    the steady call is a training step with --train.

    Example: paramfold bench --model spectral_norm --train --backend aot_eager
    """
    import json

    if plot is not None:
        from paramfold.bench.plot import require_matplotlib
        from paramfold.output import check_output

        check_output(plot, suffixes=(".png",))
        try:
            require_matplotlib()
        except ImportError as exc:
            _say("bench", str(exc))
            raise typer.Exit(2) from None

    from rich.console import Console

    from paramfold.signals import raise_if_interrupted, signals_deferred

    with signals_deferred():  # a signal during the imports is raised after them
        from paramfold.bench import BenchConfig, run_bench, run_sweep
        from paramfold.bench.config import parse_layer_counts

    err = Console(stderr=True)
    try:
        if threads < 0:  # 0 is an answer of its own: torch's setting
            raise ValueError(f"threads must be at least 0 (0 leaves torch's setting), got {threads}")
        config = BenchConfig(
            model=model, layers=layers, width=width, backend=backend, entry=entry, train=train, grad=grad,
            repeats=repeats, threads=threads or None, steady_rounds=steady_rounds,
            variants=tuple(v.value for v in variant) if variant else None, device=device,
        )
        config.check_device()
        sizes = None if sweep_layers is None else parse_layer_counts(sweep_layers, layers)
        if sizes and wide:
            raise ValueError("--wide shows one run's columns; with --sweep-layers, --json gives every sample")
    except ValueError as exc:
        _say("bench", str(exc))
        raise typer.Exit(2) from None

    def run(on_progress: Callable[[int, int, str], None]) -> Any:
        def step(done: int, total: int, label: str) -> None:
            # A safe point: a signal whose exception a GC callback or torch dropped stops the run
            # here, not after every measurement is done.
            raise_if_interrupted()
            on_progress(done, total, label)

        if sizes:
            result = run_sweep(config, sizes, on_progress=step)
        else:
            result = run_bench(config, on_progress=step)
        raise_if_interrupted()
        return result

    if err.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err, transient=True,
        ) as progress:
            task = progress.add_task("starting", total=None)

            def on_progress(done: int, total: int, label: str) -> None:
                progress.update(task, completed=done, total=total, description=label)

            result = run(on_progress)
    else:
        from paramfold.bench import plain_progress

        report = plain_progress(sys.stderr) if sys.stderr is not None else None  # (None: fd 2 closed)

        def on_progress(done: int, total: int, label: str) -> None:
            try:
                if report is not None:
                    report(done, total, label)
            except (OSError, ValueError):  # stderr gone since (its reader went away): progress is only news
                pass

        result = run(on_progress)

    from paramfold.bench import SweepResult, print_sweep, print_table
    from paramfold.bench.plot import plot_ratios, plot_sweep

    runs = result.runs if isinstance(result, SweepResult) else [result]
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    elif sizes:
        print_sweep(result)
    else:
        print_table(result, wide=wide)
    if plot is not None:
        (plot_sweep if sizes else plot_ratios)(result, plot)
    failed = [v for r in runs for v in r.variants if v.status == "error"]
    if failed:
        _say("bench", "variant(s) failed: " + "; ".join(f"{v.name}: {v.note.splitlines()[0]}" for v in failed))
        raise typer.Exit(1)


# --- audit, fold -------------------------------------------------------------------------------

# What `fold OUT` / `audit --fold-out OUT` may end in, and what a checkpoint file read may: a copy of
# paramfold.checkpoint's SAFETENSORS_SUFFIX and PT_SUFFIXES (which imports torch), test_cli checks
# the two agree; the help texts are made from it.
FOLD_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def _suffixes(items: tuple[str, ...]) -> str:
    """``".a, .b or .c"``, as the help and the errors list suffixes."""
    return ", ".join(items[:-1]) + " or " + items[-1]


_MODEL_HELP = (
    "Build the parametrized model with FACTORY() from MODULE (a dotted module or a path to a .py "
    "file), load the checkpoint into it and materialise every parametrization. Needed for kinds that "
    "cannot be folded from the checkpoint alone."
)
# fold's --dtype choices (paramfold.fold.DTYPES, which test_cli checks them against).
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
_DTYPE_HELP = (
    "Write the checkpoint of the model in this dtype (float32, float16, bfloat16, float64): every "
    "floating-point tensor is cast to it before anything is computed, as load_state_dict into "
    "model.to(DTYPE) casts it. Without it, each site is computed in its stored dtype."
)


@app.command("audit", cls=_Command)
@_guarded("audit")
def audit(
    path: str = typer.Argument(
        ..., metavar="PATH", show_default=False,
        help=f"A {'/'.join(FOLD_SUFFIXES[1:])} or {FOLD_SUFFIXES[0]} file, a *.safetensors.index.json or "
        "*.bin.index.json (and its shards), or a folder holding one.",
    ),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the report as a JSON document instead of a table."),
    fold_out: Optional[str] = typer.Option(
        None, "--fold-out", metavar="OUT",
        help="Also fold: the older spelling of `paramfold fold PATH OUT`, printed after the report.",
    ),
    model: Optional[str] = typer.Option(
        None, "--model", metavar="MODULE:FACTORY", help="With --fold-out: " + _MODEL_HELP[0].lower() + _MODEL_HELP[1:],
    ),
    dtype: Optional[Literal["float32", "float16", "bfloat16", "float64"]] = typer.Option(
        None, "--dtype", metavar="DTYPE", help="With --fold-out: " + _DTYPE_HELP[0].lower() + _DTYPE_HELP[1:],
    ),
) -> None:
    """Inspect a checkpoint for parametrizations without running its pickle.

    Example: paramfold audit vocoder.pt --json
    """
    from paramfold.output import OutputError, check_output

    for given, option in ((model, "--model"), (dtype, "--dtype")):
        if given is not None and fold_out is None:
            raise OutputError(f"{option} only applies together with --fold-out OUT")
    if fold_out is not None:  # before anything is imported or read
        check_output(fold_out, suffixes=FOLD_SUFFIXES)

    from paramfold.signals import signals_deferred

    with signals_deferred():  # a signal during the imports is raised after them
        from paramfold.audit import audit_checkpoint
        from paramfold.audit_render import print_report
        from paramfold.checkpoint import open_checkpoint
    with open_checkpoint(path) as ckpt:
        if fold_out is not None:  # refused before the report is printed
            check_output(fold_out, inputs=ckpt.files)
        report = audit_checkpoint(ckpt)
    if json_out:
        typer.echo(report.to_json())
    else:
        print_report(report)
    if fold_out is not None:
        _fold(path, fold_out, model, dtype, err=json_out)


@app.command("fold", cls=_Command)
@_guarded("fold")
def fold(
    path: str = typer.Argument(
        ..., metavar="IN", show_default=False,
        help="The parametrized checkpoint: as for `paramfold audit PATH`.",
    ),
    out: str = typer.Argument(
        ..., metavar="OUT", show_default=False,
        help=f"Where to write the unparametrized model's checkpoint, its format by the suffix: "
        f"{_suffixes(FOLD_SUFFIXES)}; not the input.",
    ),
    model: Optional[str] = typer.Option(None, "--model", metavar="MODULE:FACTORY", help=_MODEL_HELP),
    dtype: Optional[Literal["float32", "float16", "bfloat16", "float64"]] = typer.Option(
        None, "--dtype", metavar="DTYPE", help=_DTYPE_HELP,
    ),
) -> None:
    """Write the checkpoint the unparametrized model would have (<module>.<tensor> keys).

    OUT appears whole or not at all. Example: paramfold fold vocoder.pt vocoder_plain.safetensors
    """
    from paramfold.output import check_output

    check_output(out, suffixes=FOLD_SUFFIXES)  # before anything is imported or read
    _fold(path, out, model, dtype)


def _fold(path: str, out: str, model: Optional[str], dtype: Optional[str], err: bool = False) -> None:
    """What `fold` and `audit --fold-out` share: fold, then one summary line (on stderr with ``err``:
    after ``audit --json``, where stdout holds the JSON document alone, so do ``--model``'s prints)."""
    from paramfold.signals import signals_deferred
    from paramfold.terminal import printable, stdout_to_stderr

    with signals_deferred():  # a signal during the imports is raised after them
        from paramfold.fold import fold_checkpoint
    _written.clear()
    with stdout_to_stderr() if err else contextlib.nullcontext():
        summary = fold_checkpoint(path, out, model_factory=model, dtype=dtype).summary()
    _written.append(out)
    typer.echo(printable(summary), err=err)  # (OUT's name may hold a newline or an escape sequence)


# --- recompiles ---------------------------------------------------------------------------------


@app.command(
    "recompiles",
    cls=_Command,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@_guarded("recompiles")
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
        metavar="",
        help="Print the report as JSON on stdout (the script's own prints go to stderr).",
    ),
    strict: bool = typer.Option(
        False, "--strict", metavar="",
        help="Exit with code 3 if any function hit the recompile limit (a failed script's own code wins; the hit is still said).",
    ),
) -> None:
    """Run a Python script and report every torch.compile recompile: cause, category and fix.

    Example: paramfold recompiles -- python train.py --epochs 1
    """
    from paramfold.signals import signals_deferred

    with signals_deferred():  # a signal during the imports is raised after them
        from paramfold.recompiles.script import run_script
    with _os_exit_said("recompiles"):
        code = run_script(command, as_json=as_json, strict=strict, shutdown=_standalone == [True],
                          reporting=lambda: _reporting.append(True))
    raise typer.Exit(code)


@contextlib.contextmanager
def _os_exit_said(command: str) -> Iterator[None]:
    """While active, ``os._exit(n)`` in this process (``recompiles``' script calling it) says one line
    first: it ends the process at once, before the report, with a status that could be mistaken for
    one of this command's own (``--strict``'s 3). A forked child's ``os._exit`` stays silent."""
    real, pid = os._exit, os.getpid()

    def said_exit(status: int) -> NoReturn:
        if os.getpid() == pid and isinstance(status, int):
            _say(command, f"the script called os._exit({status}), which ends the process at once: no report "
                          f"was printed, and the exit status {status} is the script's own")
        real(status)

    os._exit = said_exit
    try:
        yield
    finally:
        os._exit = real


def main(*, end_process: bool = False) -> None:
    """The command line. ``end_process`` (the console script and ``python -m paramfold``, through
    :mod:`paramfold.__main__`): end the process when the command has ended (:func:`_end_process`)
    rather than raise ``SystemExit``."""
    app(end_process=end_process)


if __name__ == "__main__":
    main()
