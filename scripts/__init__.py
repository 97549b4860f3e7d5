"""Generators of test and benchmark checkpoints (run as scripts, imported by tests and bench)."""
