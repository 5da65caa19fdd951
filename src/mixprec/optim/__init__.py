"""Optimizers that compute in fp32 whatever the param dtype and round the result back.

``AdamW`` and ``SGD`` match ``torch.optim`` bit for bit on fp32 params; on bf16/fp16 params
they keep state in ``state_dtype`` and write updates back with ``rounding`` (``"nearest"``,
``"kahan"`` or ``"stochastic"``). See :mod:`mixprec.optim.rounding`. ``state_dtype="int8"`` / ``"fp8"``
keeps the moments of large tensors blockwise-quantized (:mod:`mixprec.optim.quantized_state`). Stochastic rounding
draws from a counter-based stream seeded by ``sr_seed``; :func:`adopt_sr_seed` loads a state dict saved before
that seed existed (:mod:`mixprec.optim.sr_seed`).
"""

from mixprec.optim.adamw import AdamW
from mixprec.optim.sgd import SGD
from mixprec.optim.sr_seed import adopt_sr_seed

__all__ = ["AdamW", "SGD", "adopt_sr_seed"]
