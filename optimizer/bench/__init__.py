"""Measuring the recommendation on real hardware, and learning from the measurement.

- ``scripts``: the run folder's replay files: ``trace.jsonl`` (the study's traffic as a
  timed replay sends it), ``bench-<engine>.sh`` and ``bench.json`` (what the scripts
  replay, against which config, and what that was simulated to give).
- ``results``: per-request times read from ``vllm bench serve``, SGLang's
  ``bench_serving`` and AIPerf result files, or from a simulation, in one form.
- ``compare``: a measured run beside the simulation of the same requests.
- ``fit``: the cost model's overhead, prefill and decode scales fitted to measured runs
  by replaying them through the engine, with leave-one-run-out error.
"""
