"""Reading a TOML file with errors that name the file and what went wrong."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | Path, error: type[Exception], label: str = "") -> dict[str, Any]:
    """The parsed table of ``path``; an unreadable or invalid file raises ``error`` naming
    ``label`` (default: the path)."""
    label = label or str(path)
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise error(f"{label}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{label}: not valid TOML ({exc})") from None
