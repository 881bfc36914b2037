"""Devices, buffers and executors (docs/architecture.md layer 7)."""
