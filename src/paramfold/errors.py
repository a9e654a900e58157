"""The one exception type paramfold raises for everything it refuses to do."""

from __future__ import annotations


class FoldError(RuntimeError):
    """paramfold refused an operation; the message says why and what to do instead.

    Every refusal leaves the model exactly as it was before the call.
    """
