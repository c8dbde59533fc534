"""First run: the README's main command on a cold Numba cache, then on a warm one.

Runs ``servetune tune --trace studies/data/mooncake_conversation_300s.parquet --model
meta-llama/Llama-3.1-8B --gpu h100 --slo ttft:2000,tpot:100 --rate-scale 0.3 --trials 3
--engine vllm -q`` in a subprocess, twice, each with a fresh run folder (so the study
starts over):

- cold: ``NUMBA_CACHE_DIR`` set to an empty temporary folder (``costmodels.jitcache``
  leaves a user's ``NUMBA_CACHE_DIR`` alone; without it the cache is
  ``~/.cache/servetune/numba/<source digest>``), as on a fresh machine;
- warm: the same folder, now filled by the cold run.

The subprocess is servetune's own entry point (``optimizer.cli:main``, the ``servetune``
script) with one hook: the progress callback (``TuneProgress.update``) prints a wall-clock
stamp and its own CPU time when the first trial is told, so "seconds to the first trial" is
measured from the launch, not inferred. Also printed: the total wall and CPU time (every
thread), and the compile time the CLI reports ("kernels compiled in N s": the trials' kernels
before the search, the fleet kernel the GPU sizing runs after it). Figures only; nothing is
asserted.

    python benchmarks/first_run.py [--trials 3] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["tune", "--trace", "studies/data/mooncake_conversation_300s.parquet", "--model", "meta-llama/Llama-3.1-8B",
           "--gpu", "h100", "--slo", "ttft:2000,tpot:100", "--rate-scale", "0.3", "--engine", "vllm", "-q"]

# servetune's entry point, stamping the moment the first trial is told
HOOKED = r"""
import sys, time
from optimizer.search import progress
_update = progress.TuneProgress.update
def update(self, trial, stats=None):
    if self._told == 0:
        print(f"@@first-trial {time.time():.3f} {time.process_time():.3f}", file=sys.stderr, flush=True)
    return _update(self, trial, stats)
progress.TuneProgress.update = update
from optimizer.cli import main
sys.argv = ["servetune", *sys.argv[1:]]
main()
"""


def run_once(label: str, cache: Path, run_dir: Path, trials: int, timeout: float) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    argv = [sys.executable, "-c", HOOKED, *COMMAND, "--trials", str(trials), "--run-dir", str(run_dir)]
    print(f"[{label}] servetune {' '.join(COMMAND)} --trials {trials} --run-dir {run_dir}", flush=True)
    start = time.time()
    before = _children_cpu()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"[{label}] still running after {timeout:.0f} s: stopped", flush=True)
        return {"first": None, "total": None, "compile": None, "ok": False}
    total = time.time() - start
    cpu = _children_cpu() - before
    stamp = re.search(r"@@first-trial (\d+\.\d+) (\d+\.\d+)", done.stderr)
    compiled = re.findall(r"kernels compiled in (\d+(?:\.\d+)?) s", done.stdout)  # the trials', the sizing's
    told = re.search(r"(\d+) trials in (\d+\.\d+) s", done.stdout)
    if done.returncode != 0:
        print(f"[{label}] exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", flush=True)
    return {"first": float(stamp.group(1)) - start if stamp else None, "total": total,
            "first_cpu": float(stamp.group(2)) if stamp else None, "cpu": cpu,
            "compile": sum(map(float, compiled)) if compiled else None,
            "loop": float(told.group(2)) if told else None, "ok": done.returncode == 0}


def _children_cpu() -> float:
    """User + system CPU seconds of the waited-for child processes so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take before it is stopped")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="servetune-first-run-") as tmp:
        cache = Path(tmp) / "numba"
        cache.mkdir()
        cold = run_once("cold", cache, Path(tmp) / "run-cold", args.trials, args.timeout)
        warm = run_once("warm", cache, Path(tmp) / "run-warm", args.trials, args.timeout) if cold["ok"] else None
    print()
    print(f"{'':12} {'first trial (s)':>16} {'its CPU (s)':>12} {'total (s)':>10} {'total CPU (s)':>14} "
          f"{'compile lines (s)':>18} {'trial loop (s)':>15}")
    for label, r in (("cold cache", cold), ("warm cache", warm)):
        if r is not None:
            print(f"{label:12} {_s(r['first']):>16} {_s(r.get('first_cpu')):>12} {_s(r['total']):>10} "
                  f"{_s(r.get('cpu')):>14} {_s(r['compile']):>18} {_s(r.get('loop')):>15}")
    if warm and cold["first"] and warm["first"]:
        print(f"{'cold / warm':12} {cold['first'] / warm['first']:>15.1f}x {cold['total'] / warm['total']:>9.1f}x")


if __name__ == "__main__":
    main()
