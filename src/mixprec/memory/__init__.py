"""Memory of a training step, measured: bytes saved for backward, peak live tensors, what a batch costs, and
what to recompute. Import from the modules (``mixprec.memory.saved``, ...)."""

__all__: list[str] = []
