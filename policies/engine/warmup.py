"""Warm-up: compile every kernel signature a run uses, on a tiny trace typed as a loaded one
(``servetune warmup``; the fleet warms up on the same inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from costmodels.costmodel import CostModel
from policies.config import PolicyConfig
from policies.engine.run import simulate, simulate_many


def warmup(speculative: bool = True) -> None:
    """Compile (or load from cache) every kernel on a tiny trace, with every mode exercised,
    through the entry points a study calls, so a real run compiles nothing more.
    ``speculative=False``: only for runs where no config speculates (``Statics.spec``)."""
    trace, cost, configs = warmup_inputs()
    simulate(trace, cost, configs[0])
    simulate_many(trace, cost, configs if speculative else without_speculation(configs))


def without_speculation(configs: Sequence[PolicyConfig]) -> list[PolicyConfig]:
    """The configs that never speculate: a batch of them compiles without the planner."""
    return [c for c in configs if c.speculative_mode == "off"]


def warmup_inputs():
    """A tiny trace, a synthetic cost model and configs that exercise every mode, for
    warm-up (the fleet's too). The trace has the fields, dtypes and read-only columns of a
    loaded ``studies.traces.Trace``, so the kernels compile for exactly the types a real
    run passes (policies does not import studies)."""
    n = 8
    output = np.array([5, 1, 9, 4, 2, 7, 3, 6], dtype=np.int64)
    trace = _WarmupTrace(np.linspace(0.0, 0.05, n), np.array([40, 3, 70, 5, 33, 64, 9, 12], dtype=np.int64), output)
    cost = CostModel.synthetic(kv_capacity_tokens=256, swap_capacity_tokens=256)
    base = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=4, gpu_memory_utilization=1.0)
    configs = [base, base.replace(schedule_mode="prefill_first", admission_mode="new_token_ratio"),
               base.replace(enable_prefix_caching=True, scheduling_policy="vtc", speculative_mode="dspark")]
    return trace, cost, configs


class _WarmupTrace:
    """The trace fields the engine reads, typed and frozen as ``studies.traces.Trace`` has them."""

    def __init__(self, arrival, prompt, output):
        n = self.n = len(arrival)
        columns = {"arrival_s": arrival, "prompt_tokens": prompt, "output_tokens": output, "max_tokens": output.copy(),
                   "output_estimate": output.copy(), "max_tokens_source": np.ones(n, dtype=np.int8),
                   "tenant": np.zeros(n, dtype=np.int32), "priority": np.zeros(n, dtype=np.int32),
                   "slo_class": np.zeros(n, dtype=np.int32), "deadline_s": np.full(n, np.nan),
                   "block_offsets": np.arange(n + 1, dtype=np.int64),  # one shared 32-token block each
                   "block_hashes": np.zeros(n, dtype=np.int64), "adapter": np.zeros(n, dtype=np.int32)}
        for name, values in columns.items():
            values = np.ascontiguousarray(values)
            values.flags.writeable = False
            setattr(self, name, values)
        self.block_tokens = 32
        self.tenant_names = ("default",)
        self.slo_class_names = ("default",)
        self.adapter_names = ("",)  # the base model only
        self.has_adapters = False
        self.cache_block_hashes = np.array(self.block_hashes)
