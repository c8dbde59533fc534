"""KV pool: servetune's block count against the ones vLLM logged, by step token budget.

vLLM sizes its KV pool after a profiling forward pass at ``max_num_batched_tokens``, so
the pool shrinks as the budget grows. The logged figures are two vLLM runs of
CodeLlama-34B on one 80 GB GPU at ``gpu_memory_utilization`` 0.9, block size 16 (the
issue that asked for this sizing quotes them); the model comes from its ``config.json``
fields, nothing is fitted to these two numbers. Figures only; the 2% bound is asserted in
``tests/costmodels/test_memory.py``.

    python benchmarks/kv_pool.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import build  # noqa: E402
from tests.costmodels.test_memory import CODELLAMA_34B  # noqa: E402

LOGGED = {64: 2790, 4096: 2537}  # max_num_batched_tokens -> GPU blocks vLLM logged


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(CODELLAMA_34B))
        cost = build("codellama/CodeLlama-34b-Instruct-hf", "h100", model_config=config)
    print(f"{cost.name}: weights {cost.weight_bytes / 2**30:.2f} GiB, fixed reserve "
          f"{cost.reserved_bytes / 2**30:.2f} GiB, activations {cost.activation_bytes_per_token / 1e3:.1f} KB "
          "per profiled token")
    print(f"{'budget':>7} {'vLLM logged':>12} {'servetune':>10} {'error':>7}")
    for budget, logged in LOGGED.items():
        blocks = cost.kv_capacity_blocks(0.9, 16, budget)
        print(f"{budget:7d} {logged:12,d} {blocks:10,d} {100 * (blocks / logged - 1):+6.1f}%")
    print(f"{8192:7d} {'':>12} {cost.kv_capacity_blocks(0.9, 16, 8192):10,d}")


if __name__ == "__main__":
    main()
