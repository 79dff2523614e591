"""Helpers for tests and benchmarks: tiny random checkpoints in every supported format."""
