"""Parity with vLLM 0.33.0's own scheduler: every recorded run replayed through the vLLM target.

Prints, per scenario and loop (``sync``: vLLM's Scheduler as its unit tests drive it;
``async``: EngineCore.step_with_batch_queue, what ``vllm serve`` runs), the requests whose
first token and finish fall at the same time as vLLM's, the preemption counts that agree,
and the steps identical from the first (start, tokens, first tokens, finishes). Scenarios
come from ``../shared/oracle/vllm-0.33.0/`` and ``tests/fixtures/vllm_oracle/``
(``optimizer.fidelity.parity``).

With ``--record OUT`` and a Python that has vLLM 0.33.0 (``--vllm-python``, plus the
engine-check stub ``libcuda.so.1`` folder ``--stub``), it first records fresh scenarios
with ``../shared/tools/vllm-oracle/`` into OUT (the bursts of ``--seeds``, at budgets 8192 and
2048 with a long-prefill threshold, in both loops) and includes them.

    python benchmarks/vllm_parity.py
    python benchmarks/vllm_parity.py --record /tmp/parity --vllm-python VENV/bin/python --stub STUB --seeds 3,4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optimizer.fidelity import parity  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
HARNESS = SHARED / "tools" / "vllm-oracle"
MODEL_CONFIG = ROOT / "costmodels" / "data" / "models" / "meta-llama--Meta-Llama-3.1-8B_config.json"
BURST = ["--n", "150", "--span", "1", "--blocks", "1500", "--max-model-len", "24000", "--max-num-seqs", "256"]


def record(out: Path, vllm_python: str, stub: str, seeds: list[int]) -> list[Path]:
    """Build burst scenarios for ``seeds`` and record vLLM's two loops on them."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(out / ".numba")}
    folders = []
    for seed in seeds:
        for name, extra in ((f"burst-s{seed}", []), (f"burst-s{seed}-b2048-t256", ["--budget", "2048", "--threshold", "256"])):
            folder = out / name
            subprocess.run([sys.executable, str(HARNESS / "scenario.py"), "burst", str(folder), *BURST, "--seed", str(seed),
                            *extra, "--servetune-src", str(ROOT)], check=True, env=env, stdout=subprocess.DEVNULL)
            folders.append(folder)
    subprocess.run([vllm_python, str(HARNESS / "vllm_driver.py"), *map(str, folders), "--model-config", str(MODEL_CONFIG),
                    "--mode", "sync,async", "--servetune-src", str(ROOT), "--work", str(out / ".vllm-work")],
                   check=True, env={**env, "LD_LIBRARY_PATH": stub})
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, help="record fresh scenarios into this folder first")
    parser.add_argument("--vllm-python", help="a Python with vLLM 0.33.0 installed (for --record)")
    parser.add_argument("--stub", help="folder holding engine-check's libcuda.so.1 (for --record)")
    parser.add_argument("--seeds", default="3", help="burst seeds to record, comma-separated")
    args = parser.parse_args()
    folders = parity.scenarios(SHARED / "oracle" / "vllm-0.33.0", ROOT / "tests" / "fixtures" / "vllm_oracle")
    if args.record:
        if not (args.vllm_python and args.stub):
            parser.error("--record needs --vllm-python and --stub")
        folders += record(args.record, args.vllm_python, args.stub, [int(s) for s in args.seeds.split(",")])
    if not folders:
        sys.exit(f"no recorded scenarios under {SHARED / 'oracle'} or tests/fixtures/vllm_oracle")
    print("| scenario | recorded in | loop | requests | same first token and finish | same preemptions | "
          "steps vLLM / servetune | identical steps | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    exact = total = 0
    for folder in folders:
        scenario = parity.load(folder)
        for mode in scenario.modes:
            a = parity.agreement(scenario, mode)
            total += 1
            exact += a.exact
            where = folder.parent.relative_to(ROOT) if folder.is_relative_to(ROOT) else "../shared/oracle"
            print(f"| {scenario.name} | {where} | {mode} | {a.requests} | {a.same_both} ({a.same_both / a.requests:.1%}) | "
                  f"{a.same_preemptions} | {a.steps_vllm} / {a.steps_servetune} | {a.same_steps} | "
                  f"{'yes' if a.exact else 'no'} |")
    print(f"\n{exact} of {total} recorded runs reproduced exactly, every request and every step.")


if __name__ == "__main__":
    main()
