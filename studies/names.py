"""Naming names a file or table does not know, with the known name each was probably meant to be.

One place builds the "unknown column / key / knob" clause, so every reader (trace files,
SLO tables, study specs) says the same thing the same way: which names are unknown, the
closest known name for each (``difflib``), and what is valid.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely misspells, or None when none is close.

    Case is ignored when comparing, so ``Timestamp`` finds ``TIMESTAMP``.
    """
    known = list(known)
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def unknown_names(kind: str, names: Iterable[str], known: Iterable[str], valid: str = "valid") -> str:
    """``unknown key(s) ['deadline'] (did you mean 'deadline_s'?); valid: [...]``.

    ``kind`` is what the names are (column, key, knob); ``valid`` the word before the
    list of known names (e.g. ``expected only``).
    """
    names, known = sorted(names), list(known)
    hints = [f"{name!r} -> {match!r}" for name in names if (match := closest(name, known))]
    if len(names) == 1 and hints:
        hint = f" (did you mean {closest(names[0], known)!r}?)"
    else:
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"unknown {kind}(s) {names}{hint}; {valid}: {known}"
