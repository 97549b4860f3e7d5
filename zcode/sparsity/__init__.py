"""Dynamic sparsity (issue 6): TEAL-style FFN activation thresholds with a kernel that skips the
weight rows of dropped inputs, static layer and KV-head skipping, the calibration artifact that
holds them; the planner (zcode.harness.planner) chooses among its levels."""
