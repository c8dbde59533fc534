"""The question being studied: traces, synthetic workloads, SLO classes, goodput reports."""
