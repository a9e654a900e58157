"""``paramfold recompiles -- python script.py [ARGS]``: run a script under :func:`recompiles`.

The script (or ``-m module``) runs in this process, as ``python`` would run it: its own
``sys.argv``, its folder (or the working directory for ``-m``) first on ``sys.path``, its exit status
kept, the signal handling python gives it (SIGTERM and SIGHUP end the process, in its forked
children too; see :func:`~paramfold.signals.signals_as_python`), and, from the command line, to its
end: its non-daemon threads joined and its ``atexit`` functions run (:func:`~paramfold.signals.python_exit_steps`), so that
what they compile is reported. Then the report is printed: rich tables, or with ``as_json`` one JSON document on stdout
(the script's own output goes to stderr so that stdout stays parseable: its prints, and what
reaches file descriptor 1, as child processes' output). What the script prints, its
traceback included (from its own first frame, through ``sys.excepthook``), is its own output,
except dynamo's multi-line recompile-limit warning: the report shows that hit with its cause and
fix, and ``--strict`` says it in one error line. What goes
wrong with the command itself is raised as :class:`ScriptError` (exit code 2), for the command
line to print in its one format.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import io
import os
import pkgutil
import re
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Callable

from paramfold.errors import FoldError
from paramfold.terminal import given_stdout, stdout_to_stderr
from paramfold.recompiles.collect import RecompileLimitError, limit_message, recompiles
from paramfold.signals import Interrupted, python_exit_steps, signals_as_python

__all__ = ["ScriptError", "run_script"]

USAGE = "paramfold recompiles -- python SCRIPT [ARGS]..."


class ScriptError(FoldError):
    """Nothing runnable was named: no script, a missing file, an unknown module. ``exit_code`` 2."""

    exit_code = 2


def run_script(command: list[str], *, as_json: bool = False, strict: bool = False, shutdown: bool = False,
               reporting: Callable[[], object] | None = None) -> int:
    """Run ``[python] SCRIPT [ARGS]`` or ``[python] -m MODULE [ARGS]``, print the report, return its exit code.

    The exit code is the script's (``sys.exit(n)``; 1 if it raised). ``strict``: if a function hit
    the recompile limit, raises :class:`RecompileLimitError` after the report is printed, with exit
    code 3 where the script succeeded, else with the script's own code (the failure it reports
    comes first).

    Signals, while the script runs, are handled as in a plain ``python`` process
    (:func:`~paramfold.signals.signals_as_python`): SIGTERM and SIGHUP end the process at once with
    143 / 129 (no report: as under python, the script's own handler, if it sets one, decides), and
    the script's forked children inherit that; a Ctrl-C (SIGINT) that the script does not catch is
    raised again after the report of what ran before it; a ``KeyboardInterrupt`` the script raised
    itself is its failure (its traceback, 130, as python).

    ``shutdown``: the process ends after this call (the command line): after the script's own code,
    Python's exit steps run for it before the report is made, as ``python`` runs them before it
    exits: its non-daemon threads are joined and its ``atexit`` functions run (see
    :func:`~paramfold.signals.python_exit_steps`), so that what they compile is counted and what they print goes where
    the script's prints go (stderr with ``as_json``). Left to the host process otherwise.

    ``reporting``: called once the script has ended (or was interrupted) and its report is to be
    made, so that the caller can tell an interrupt after it (the report covers what ran) from one
    while the command was still starting (the script never ran, no report).
    """
    tokens = list(command)
    if tokens and tokens[0].startswith("-") and tokens[0] != "-m":  # a mistyped option of ours, before --
        raise ScriptError(f"unknown option {tokens[0]}: paramfold recompiles takes --json and --strict before --; "
                          "after it, a script file or -m MODULE (python's own options are not supported)")
    if tokens and (tokens[0] == sys.executable or re.fullmatch(r"python[\d.]*(\.exe)?", os.path.basename(tokens[0]))):
        tokens = tokens[1:]
    if not tokens or (tokens[0] == "-m" and len(tokens) < 2):
        raise ScriptError(f"nothing to run; usage: {USAGE}")
    if tokens[0].startswith("-") and tokens[0] != "-m":  # as python reads it: an option, not a script
        raise ScriptError(f"python's option {tokens[0]} is not supported here: give a script file "
                          "(code for -c put in one) or -m MODULE")
    old_argv, old_path = sys.argv[:], sys.path[:]
    if tokens[0] == "-m":
        module: str | None = tokens[1]
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
        failed: BaseException | None = None
        try:
            spec = importlib.util.find_spec(module)
        except Exception as e:
            # Not found by the import system alone, or raised by a parent package's own code
            # (its __init__ ran): then, as python, that code's traceback and exit 1.
            spec, failed = None, None if _before_the_script(e) else e
        if spec is None and failed is None:
            sys.path[:] = old_path
            raise ScriptError(f"no module named {module!r}")
        argv0, rest = (spec.origin or module) if spec is not None else module, tokens[2:]
    else:
        module, argv0, rest, failed = None, tokens[0], tokens[1:], None
        if not argv0:
            raise ScriptError("no script given (an empty string)")
        if not os.path.exists(argv0):
            raise ScriptError(f"script not found: {argv0}")
        elif not (os.path.isfile(argv0) or os.path.isdir(argv0)):  # a FIFO or a device: read, it could block or never end
            raise ScriptError(f"script is not a regular file (a FIFO, a device or a socket): {argv0}")
        if not os.access(argv0, os.R_OK):
            raise ScriptError(f"script not readable (permission denied): {argv0}")
        if _by_runpy(argv0) and not _has_main(argv0):  # a folder or zip (a .pt checkpoint) python cannot run
            raise ScriptError(f"can't find '__main__' module in {argv0!r}")

    sys.argv = [argv0, *rest]
    if module is None and not os.path.isdir(argv0):  # runpy puts a folder on sys.path itself
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv0)))
    redirect = stdout_to_stderr() if as_json else contextlib.nullcontext()
    try:
        # The script meets a closed stdout as under python (its BrokenPipeError is its own).
        with given_stdout(), redirect, recompiles(warn=False, torch_warning=False) as report:
            code, interrupted = _run_as_python(module, argv0, shutdown=shutdown, failed=failed)
            if reporting is not None:
                reporting()
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    if as_json:
        # Flushed here, so that a write that fails (a full disk) fails the command, as the table does:
        # nowhere where stdout was closed from the start (None).
        print(report.to_json(), flush=True)
    else:
        report.print()
    if interrupted is not None:
        raise interrupted
    if strict and report.limit_hit:
        if code == 0:
            raise RecompileLimitError(limit_message(report))
        error = RecompileLimitError(f"{limit_message(report)} (the script itself exited with {code}: its status is kept)")
        error.exit_code = code  # said all the same: a log that shows only stderr learns of the hit
        raise error
    return code


def _run_as_python(module: str | None, argv0: str, *, shutdown: bool,
                   failed: BaseException | None = None) -> tuple[int, BaseException | None]:
    """Run the script as ``python`` would, its signals handled as there: (exit code, the
    interrupt to raise again after the report, or None). ``failed``: what the package of a ``-m``
    module raised as it was imported to find it, which python reports as the script's own."""
    code, interrupted = 0, None
    with signals_as_python() as came_from_sigint:
        try:
            if failed is not None:
                raise failed
            if module is None:
                _run_path(argv0)
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # sys.exit("message"), as python prints it
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt as e:  # the report of what ran so far is still printed
            if came_from_sigint(e):
                interrupted = Interrupted(signal.SIGINT)
            else:  # raised by the script itself, no signal: as python, its traceback and 130
                _print_script_traceback(e)
                code = 130
        except Exception as e:
            if _before_the_script(e):  # runpy could not find or load it: the command's failure, as python says it
                raise ScriptError(str(e).strip() or type(e).__name__) from None
            _print_script_traceback(e)
            code = 1
        if shutdown:
            try:
                python_exit_steps()
            except KeyboardInterrupt:  # a Ctrl-C while its threads are waited for: the report
                interrupted = interrupted or Interrupted(signal.SIGINT)
    return code, interrupted


def _print_script_traceback(exc: BaseException) -> None:
    """The script's own traceback, printed as ``python`` prints it (through ``sys.excepthook``,
    which the script may have set): from the script's first frame, without the frames of this
    module and of runpy that ran it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _RUNNER_FILES:
        tb = tb.tb_next
    exc.with_traceback(tb)  # the hook prints the exception's own traceback, not its argument
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # a hook of the script's that fails: python's own printing
        traceback.print_exception(type(exc), exc, tb)


def _before_the_script(exc: BaseException) -> bool:
    """Whether ``exc`` is runpy's failure to find or load the script (no ``__main__`` in a package
    run with ``-m``, a file it cannot read), raised before the script's first line: neither it nor
    the exceptions it was raised from or while handling has a frame outside the runner (this module,
    runpy, the import system). A syntax error is the script's own (python prints it, exit 1)."""
    if isinstance(exc, SyntaxError):
        return False
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename not in _RUNNER_FILES:
                return False
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return True


def _by_runpy(argv0: str) -> bool:
    """Whether :func:`_run_path` hands ``argv0`` to runpy: a folder, a zip, a ``.pyc``, anything but ``.py``."""
    return os.path.isdir(argv0) or not argv0.endswith(".py")


def _has_main(argv0: str) -> bool:
    """For a folder or a zip archive, whether it holds a ``__main__`` module python can run, found
    as runpy finds it (a ``__main__.py`` or ``.pyc``, not a package); any other file is run as code."""
    importer = pkgutil.get_importer(os.path.abspath(argv0))
    if importer is None:  # not a path entry (a .pyc, a script without the .py suffix): run as code
        return True
    try:
        spec = importer.find_spec("__main__")
    except (ImportError, OSError):
        return False
    return spec is not None and spec.loader is not None and spec.submodule_search_locations is None


def _run_path(argv0: str) -> None:
    """Run the script or folder ``argv0`` as ``python argv0`` does: its ``__file__`` absolute (the
    working directory joined in front, so that it finds its files after an ``os.chdir``). For a
    ``.py`` script ``sys.argv[0]`` stays as typed; runpy, which runs folders, zips and ``.pyc``
    files here, sets it to the absolute path it is given."""
    absolute = os.path.join(os.getcwd(), argv0)
    if _by_runpy(argv0):  # a folder, a zip, a .pyc: runpy's loaders
        runpy.run_path(absolute, run_name="__main__")
        return
    with io.open_code(absolute) as f:
        code = compile(f.read(), absolute, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=absolute, __cached__=None, __loader__=None, __package__=None,
                         __spec__=None, __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # as runpy does: pickling what the script defines finds it
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


_RUNNER_FILES = {_run_path.__code__.co_filename, runpy.run_path.__code__.co_filename,
                 pkgutil.get_importer.__code__.co_filename, importlib.util.find_spec.__code__.co_filename,
                 "<frozen importlib._bootstrap>",
                 "<frozen importlib._bootstrap_external>", "<frozen zipimport>"}
