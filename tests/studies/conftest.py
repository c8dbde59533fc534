"""Shared fixtures: where the real traces live, and a field-by-field trace comparison."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from studies.traces import Trace

SHARED = Path(os.environ.get("SERVETUNE_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
MOONCAKE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
AZURE = SHARED / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def write(tmp_path: Path, name: str, text: str) -> Path:
    """A small trace file of ``text`` in the test's folder."""
    path = tmp_path / name
    path.write_text(text)
    return path


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"real trace not found at {path} (set SERVETUNE_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def mooncake_path() -> Path:
    return _need(MOONCAKE)


@pytest.fixture(scope="session")
def azure_path() -> Path:
    return _need(AZURE)


COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "priority", "deadline_s",
           "block_offsets", "block_hashes")


def assert_same_trace(a: Trace, b: Trace, *, codes: bool = False) -> None:
    """Every field equal; tenants and SLO classes compared by name (or by code too)."""
    for column in COLUMNS:
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column), err_msg=column)
    assert a.block_tokens == b.block_tokens
    assert list(a.tenant_labels) == list(b.tenant_labels)
    assert list(a.slo_class_labels) == list(b.slo_class_labels)
    if codes:
        assert a.tenant_names == b.tenant_names and a.slo_class_names == b.slo_class_names
        np.testing.assert_array_equal(a.tenant, b.tenant)
        np.testing.assert_array_equal(a.slo_class, b.slo_class)
