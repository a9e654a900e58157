"""The one exception type paramfold raises for everything it refuses to do, and the wording helpers
of its messages."""

from __future__ import annotations

from collections.abc import Sequence


class FoldError(RuntimeError):
    """paramfold refused an operation; the message says why and what to do instead.

    Every refusal leaves the model exactly as it was before the call.
    """


def one_line(text: str) -> str:
    """Another library's message (torch's, a user's exception) in one line: its line breaks and
    indentation are layout, not data, and become single spaces. paramfold's own messages are one
    line by construction; the command line escapes any control character left (a path's newline
    is shown as ``\\n``, not turned into a space that names another file)."""
    return " ".join(text.split())


def first_few(items: Sequence[str], limit: int) -> str:
    """``"a, b, c and 2 more"``: the first ``limit`` items of a message's list, then a count."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def counted(n: int, noun: str) -> str:
    """``"1 tensor"``, ``"3 tensors"``: ``n`` and ``noun``, plural but for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def with_article(name: str) -> str:
    """``"an int"``, ``"a Tensor"``, ``"a uint8"``: ``name`` (a type's, a dtype's) after its article,
    as it is said: "an" before a vowel sound."""
    sounds_like_you = name.lower().startswith(("uint", "uni", "use", "usu", "uti"))
    return f"{'an' if name[:1].lower() in 'aeiou' and not sounds_like_you else 'a'} {name}"
