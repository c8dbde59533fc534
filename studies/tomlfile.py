"""Reading a TOML file with errors that name the file and what went wrong."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | Path, error: type[Exception], label: str = "") -> dict[str, Any]:
    """The parsed table of ``path``; an unreadable or invalid file raises ``error`` naming
    ``label`` (default: the path), and the line of bytes that are not UTF-8 (TOML's encoding)."""
    label = label or str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{label}: cannot read ({exc.strerror})") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{label}: line {line}: {data[exc.start:exc.end]!r} is not UTF-8; TOML files are "
                    f"UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{label}: not valid TOML ({exc})") from None
