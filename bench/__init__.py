"""Benchmarks: each script prints agentkey against its baseline from one run."""
