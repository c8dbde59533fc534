"""Locate ../shared (profiles, measured runs); tests that need it skip without it."""

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("SERVETUNE_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
AIC = SHARED / "profiles" / "aiconfigurator" / "aiconfigurator_core"
SILICON = AIC / "systems" / "silicon_dense_h100.csv"


@pytest.fixture
def aic_root() -> Path:
    if not AIC.is_dir():
        pytest.skip(f"raw profiles not found at {AIC} (set SERVETUNE_SHARED)")
    return AIC
