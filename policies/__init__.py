"""Candidate answers: PolicyConfig and the Numba-jitted engine that executes a policy."""
