"""Precision policies: the Policy, its text, presets, resolution on a device, and auto."""
