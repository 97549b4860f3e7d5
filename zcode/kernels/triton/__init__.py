"""Triton kernels (registered for backend `cuda`)."""
