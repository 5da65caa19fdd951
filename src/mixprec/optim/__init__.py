"""Optimizers that compute in fp32 whatever the param dtype and round the result back.

``AdamW`` and ``SGD`` match ``torch.optim`` bit for bit on fp32 params; on bf16/fp16 params
they keep state in ``state_dtype`` and write updates back with ``rounding`` (``"nearest"``,
``"kahan"`` or ``"stochastic"``). See :mod:`mixprec.optim.rounding`. ``state_dtype="int8"`` / ``"fp8"``
keeps the moments of large tensors blockwise-quantized (:mod:`mixprec.optim.quantized_state`).
"""

from mixprec.optim.adamw import AdamW
from mixprec.optim.sgd import SGD

__all__ = ["AdamW", "SGD"]
