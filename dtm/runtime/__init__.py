"""Devices, buffers and executors (DESIGN.md layer 7)."""
