"""Candidate answers: PolicyConfig and the Numba-jitted engine that executes a policy."""

# Key Numba's cache on the jitted sources before any kernel module below is imported.
from costmodels import jitcache  # noqa: F401
