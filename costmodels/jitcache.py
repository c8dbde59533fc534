"""Key Numba's on-disk cache on the source of every jitted module.

Numba invalidates a cached function only when its *own* file changes; a kernel that
inlines helpers from other files (the engine calls the step-time lookup, the prefix
cache and the queues) would keep stale machine code after those files change. Pointing
``numba.config.CACHE_DIR`` at a folder named by a hash of all jitted sources makes any
edit, or an upgrade, start from a clean cache. A user's own ``NUMBA_CACHE_DIR`` wins.

It runs on import, before the first ``@njit(cache=True)`` decorator executes: the
``costmodels`` package (imported by every jitted module) imports this module first.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

# Packages holding @njit(cache=True) code; costmodels sits below policies, so it names both.
JIT_PACKAGES = ("costmodels", "policies")


def source_digest(root: Path) -> str:
    digest = hashlib.sha256(numba.__version__.encode())
    for package in JIT_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):  # subpackages too (policies.engine)
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def configure() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "servetune" / "numba"
    numba.config.CACHE_DIR = str(base / source_digest(Path(__file__).resolve().parents[1]))


configure()
