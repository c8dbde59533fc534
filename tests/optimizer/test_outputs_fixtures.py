"""Small hand-built inputs shared by the outputs tests (exports, plots, review, run folder)."""

from __future__ import annotations

import numpy as np

from studies.traces import Trace


def make_trace(arrival_s, prompts, outputs) -> Trace:
    """A one-tenant, one-class trace without prefix blocks."""
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    n = len(arrival_s)
    return Trace(
        arrival_s=arrival_s,
        prompt_tokens=np.asarray(prompts),
        output_tokens=np.asarray(outputs),
        max_tokens=np.maximum(np.asarray(outputs), 1),
        tenant=np.zeros(n),
        priority=np.zeros(n),
        slo_class=np.zeros(n),
        deadline_s=np.full(n, np.nan),
        block_offsets=np.zeros(n + 1),
        block_hashes=np.zeros(0),
        source="test",
    )
