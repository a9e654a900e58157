"""Output files that appear whole or not at all, and output paths checked before any work.

Every file paramfold writes (folded checkpoints, bench plots) goes through :func:`atomic_output`:
the data goes to a hidden temporary file beside the target, which is flushed, fsynced, given
the permissions a plain ``open(path, "w")`` would give (the target's mode when it exists, else
``0o666`` less the umask) and renamed over the target only when complete. On any error, and on
SIGINT, SIGTERM or SIGHUP while :func:`paramfold.signals.signals_raise` is active (the CLI
activates it), the temporary file is removed and a pre-existing target is left byte-identical.

This module imports nothing heavy (no torch), so the CLI can validate an output path before it
imports anything else.

Example::

    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), "out.txt")
    >>> with atomic_output(target) as f:
    ...     _ = f.write(b"complete")
    >>> open(target, "rb").read(), os.listdir(os.path.dirname(target))
    (b'complete', ['out.txt'])
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from paramfold.errors import FoldError
from paramfold.signals import Interrupted, pending_signal, raise_if_interrupted, signal_arrived, signals_blocked

__all__ = ["OutputError", "atomic_output", "check_output", "describe_os_error", "destination"]


class OutputError(FoldError):
    """An output path cannot be written as asked. ``exit_code`` 2: fix the command line."""

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_output(
    path: str | os.PathLike[str],
    *,
    suffixes: Iterable[str] | None = None,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Refuse, before any work, an output path that cannot be written or would overwrite an input.

    ``suffixes`` (lower case, e.g. ``(".safetensors", ".pt")``) are the accepted file endings;
    ``inputs`` are the files the command reads (output over an input is refused: the input would
    be lost if anything went wrong, and it is still being read). Raises :class:`OutputError`.

    Example::

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> check_output(os.path.join(d, "x.gguf"), suffixes=(".pt",))
        Traceback (most recent call last):
        ...
        paramfold.output.OutputError: ...x.gguf: unsupported output format '.gguf': use .pt
    """
    if not str(path).strip():  # Path("") is the current folder
        raise OutputError("no output path given (an empty string)")
    out = Path(path)
    suffixes = None if suffixes is None else tuple(suffixes)
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: "out.pt/" would be written as a file
        raise OutputError(f"{path}: names a folder (it ends with a slash); give a file name" + (
            f" ending in {_alternatives(suffixes)}" if suffixes is not None else ""))
    dest = destination(out)
    parent = dest.parent if str(dest.parent) else Path(".")
    try:
        mode = os.stat(out).st_mode  # through links: the file the rename would replace
    except (FileNotFoundError, NotADirectoryError):  # the folder checks below say which
        mode = None
    except OSError as e:  # a name too long, a loop of links
        raise OutputError(f"{out}: cannot be used as an output path: {e.strerror}") from None
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; give a file name" + (
            f" ending in {_alternatives(suffixes)}" if suffixes else ""))
    if mode is not None and not stat.S_ISREG(mode):
        # open() would write into a FIFO or a device; the rename would replace the node itself.
        where = f"{out}: links to {dest}, which" if dest != out else f"{out}:"
        raise OutputError(
            f"{where} is not a regular file (a FIFO, a device or a socket): refusing to replace it; "
            "give the name of a regular file"
        )
    # After what the path is: a folder named "runs" or /dev/full is no unsupported format.
    if suffixes is not None and not out.name.lower().endswith(suffixes):
        if not out.suffix:  # "noext", ".hidden": no format to name
            raise OutputError(f"{out}: the name has no suffix to say the format: give a name ending in "
                              f"{_alternatives(suffixes)}")
        raise OutputError(f"{out}: unsupported output format '{out.suffix}': use {_alternatives(suffixes)}")
    if suffixes is not None and out.name.lower() in suffixes:  # ".safetensors": a hidden file of no name
        raise OutputError(f"{out}: the name is only a suffix: give a file name before it (model{out.name})")
    if not parent.is_dir():
        raise OutputError(f"{out}: {_no_folder(parent)}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: cannot write in {parent}: permission denied")
    if out.exists() and not os.access(out, os.W_OK):  # as open() for writing would refuse it
        raise OutputError(f"{out}: is read-only: make it writable (chmod u+w) or write to another file name")
    for src in inputs:
        src = Path(src)
        if _same_file(out, src):
            raise OutputError(
                f"{out}: is the input {src}; refusing to overwrite it (the original would be "
                "lost): write to another file name, then rename it yourself"
            )
    return out


def destination(out: Path) -> Path:
    """Where writing ``out`` puts the bytes: the file a symbolic link points to (resolved from the
    link's folder, through further links), as ``open()``, ``torch.save`` and safetensors' writers
    follow it; ``out`` itself otherwise. The link is kept."""
    try:
        return Path(os.path.realpath(out)) if out.is_symlink() else out
    except OSError:  # a name too long, say: check_output says why in one line
        return out


def _no_folder(folder: Path) -> str:
    """Why ``folder``, an output's folder, is none: it is missing, or it or a folder above it is a
    file (or a FIFO, a device), which no folder can be made in."""
    for above in (folder, *folder.parents):
        try:
            mode = os.stat(above).st_mode
        except OSError:  # missing (or not reachable): the one above says
            continue
        if stat.S_ISDIR(mode):
            break
        what = "a file" if stat.S_ISREG(mode) else "a FIFO, a device or a socket"
        if above == folder:
            return f"the output folder {folder} is {what}, not a folder"
        return f"the output folder {folder} cannot exist: {above} is {what}, not a folder"
    return f"the output folder {folder} does not exist"


def _alternatives(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _new_file_mode(target: Path) -> int:
    """The mode ``open(target, "w")`` would leave: the existing file's, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        pass
    umask = _umask()
    return 0o666 & ~umask


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask has no getter, and is process-wide)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` (a link's target: :func:`destination`) only if the block
    completes; nothing is left otherwise.

    Checks ``path`` with :func:`check_output` first (without suffix or input checks). The
    temporary file is ``.<name>.<random>.partial`` in the same folder (so the rename is atomic).
    A handled signal that arrives while the file is being committed is delivered after the
    rename if the rename already happened, else the file is discarded; so is the file after a
    handled signal whose :class:`Interrupted` was caught and dropped (:func:`signals_raise`).
    """
    raise_if_interrupted()  # no output is begun after a signal, even one whose exception was dropped
    out = check_output(path)
    dest = destination(out)  # the temporary file goes beside it, so that the rename is atomic
    parent = dest.parent if str(dest.parent) else Path(".")
    mode = _new_file_mode(dest)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=parent, prefix=_temporary_prefix(out.name, parent), suffix=".partial")
        os.close(fd)
    except OSError as e:
        raise OutputError(f"{out}: cannot create a file in {parent}: {e.strerror}", exit_code=1) from None
    tmp = Path(tmp_name)
    try:
        with open(tmp, "wb") as f:  # f.name is the temporary path: a writer may close f, use it
            yield f
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it the output
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        with signals_blocked():
            pending = pending_signal() or signal_arrived()  # also one whose exception was dropped
            if pending is None:
                os.replace(tmp, dest)
        if pending is not None:  # unblocking delivered it already; this is the fallback
            raise Interrupted(pending)
    except OSError as e:
        _discard(tmp)
        if e.filename in (None, str(tmp)):  # name the output, not the temporary file (gone now)
            hint = ": free some space or write the output elsewhere" if e.errno in _FULL else ""
            raise OutputError(f"{out}: cannot write: {e.strerror or e}{hint}; nothing was written", exit_code=1) from None
        raise
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    """Remove the temporary file, also where a second signal arrives meanwhile (Ctrl-C twice,
    SIGINT then SIGTERM): its handler may raise on the way into or out of the blocked section,
    which a mask cannot stop once the signal is received. Its exception is dropped here, and
    raised again where the command ends (:func:`~paramfold.signals.signals_raise` remembers it);
    the first one, on its way, says what happened."""
    while True:
        try:
            with signals_blocked():
                tmp.unlink(missing_ok=True)
            return
        except Interrupted:
            continue


def _temporary_prefix(name: str, parent: Path) -> str:
    """``.<name>.``, with ``name`` shortened where the whole temporary name would exceed the
    folder's limit on a name's bytes (an output named near that limit is a valid output)."""
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = name_max - len("..") - 8 - len(".partial")  # 8: the length of mkstemp's random part
    while name and len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}."


_FULL = {getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n)}


def describe_os_error(e: OSError) -> str:
    """One line for an ``OSError``: the file, what went wrong, and for a full disk what to do."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        return f"{where}{what}: free some space or write the output elsewhere; nothing was written"
    return f"{where}{what}"
