"""Block-scaled formats: MXFP8 / MXFP6 / MXFP4 (OCP Microscaling v1.0) and NVFP4, quantized bit for bit.

The formats are data in :mod:`mixprec.formats` (:class:`~mixprec.formats.BlockFormat`, presets
``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp4_e2m1``, ``nvfp4``). Here:
:func:`quantize` cuts a tensor's last dim into blocks and returns a :class:`BlockQuantized` (element codes,
block scale codes, NVFP4's tensor scale), whose :meth:`~BlockQuantized.dequantize` (or :func:`dequantize`) gives
fp32 back; :func:`round_to_element` rounds fp32 values onto an element format's grid (nearest-even or
stochastic), :func:`encode` / :func:`decode` convert element values and codes. The algorithms and the
conventions chosen where the specs are silent are stated in :mod:`mixprec.blockscale.quantize` and
:mod:`mixprec.blockscale.scales`. Everything is fp32 tensor arithmetic: any device, no host sync,
``torch.compile``-able; no hardware block-scaled GEMM is used here.
"""

from mixprec.blockscale.elements import decode, encode, round_to_element
from mixprec.blockscale.quantize import BlockQuantized, dequantize, quantize

__all__ = ["BlockQuantized", "decode", "dequantize", "encode", "quantize", "round_to_element"]
