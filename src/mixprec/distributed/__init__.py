"""Multi-process training: process group, DDP / FSDP2 wrapping, the step's strategy."""
