"""Checkpoints of a run: one save/load for one process or many (DCP), crash-safe."""
