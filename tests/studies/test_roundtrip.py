"""Writing and reading back: native keeps every field; Mooncake and Azure keep theirs."""

import numpy as np
import pytest

from studies.synthetic import Conversation, Gamma, OutputEstimate, SharedPrefix, Tenant, generate
from studies.traces import Trace, load_trace, write_trace
from tests.studies.conftest import assert_same_trace


@pytest.fixture(scope="module")
def rich() -> Trace:
    """Every field in use: tenants, classes, priorities, deadlines, caps, shared blocks."""
    return generate(Gamma(rate=20, cv=2), duration_s=30, seed=3, tenants=[
        Tenant("chat", weight=2, priority=1, slo_class="fast", deadline_s=20.0,
               prefix=SharedPrefix(groups=2, prefix_tokens=1024), conversation=Conversation(2, 3)),
        Tenant("batch", slo_class="slow", estimate=OutputEstimate(bias=1.5, cv=0.3)),
    ])


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_native_round_trip_keeps_every_field(tmp_path, rich, suffix):
    back = load_trace(write_trace(rich, tmp_path / f"t{suffix}"))
    assert_same_trace(rich, back, codes=suffix == ".parquet")
    assert back.meta["format"] == "native"


def test_parquet_keeps_unused_names_and_source(tmp_path, rich):
    trace = rich.replace(tenant_names=(*rich.tenant_names, "idle"))
    back = load_trace(write_trace(trace, tmp_path / "t.parquet"))
    assert back.tenant_names == trace.tenant_names and back.source == rich.source


def test_mooncake_native_mooncake(tmp_path, mooncake_path):
    original = load_trace(mooncake_path, spread="raw")
    native = load_trace(write_trace(original, tmp_path / "m.parquet"))
    assert_same_trace(original, native, codes=True)
    again = load_trace(write_trace(native, tmp_path / "m.jsonl", "mooncake"), spread="raw")
    assert_same_trace(original, again, codes=True)


def test_azure_native_azure(tmp_path, azure_path):
    original = load_trace(azure_path)
    native = load_trace(write_trace(original, tmp_path / "a.parquet"))  # Parquet keeps meta too
    assert_same_trace(original, native)
    again = load_trace(write_trace(native, tmp_path / "a2.csv", "azure"))
    np.testing.assert_allclose(again.arrival_s, original.arrival_s, atol=1e-9)  # microseconds both ways
    assert_same_trace(original, again.replace(arrival_s=original.arrival_s))
    assert again.meta["start_time"] == original.meta["start_time"]
