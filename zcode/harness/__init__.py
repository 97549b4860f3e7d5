"""The per-request execution plan and the planners that choose it."""

from zcode.harness.plan import ExecutionPlan

__all__ = ["ExecutionPlan"]
