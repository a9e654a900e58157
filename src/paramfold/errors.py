"""The one exception type paramfold raises for everything it refuses to do."""

from __future__ import annotations

from collections.abc import Sequence


class FoldError(RuntimeError):
    """paramfold refused an operation; the message says why and what to do instead.

    Every refusal leaves the model exactly as it was before the call.
    """


def first_few(items: Sequence[str], limit: int) -> str:
    """``"a, b, c and 2 more"``: the first ``limit`` items of a message's list, then a count."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
