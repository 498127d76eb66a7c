"""Low precision: reference quantizers behind one contract, quantize-on-export, INT4 QAT.

- formats.py: quantize / dequantize / part names for fp8 (128x128), mxfp8, mxfp4, nvfp4, int4.
- keep.py: the keep-in-BF16 list (exact, module prefix or glob; never substring).
- export.py: QuantizingTransport, the wrapper make_transport puts around a transport.
- qat.py: INT4 fake-quant with a straight-through estimator for the FSDP forward.
- train.py: `quant.train` as a model transform before fully_shard (QAT; torchao float8, CUDA only).
- config.py: the `[quant]` recipe section.
The engine side is miles/engines/embedded_engine/quantized.py (loading) and fp8_gemm.py.
"""

import importlib

# Lazy (PEP 562): the recipe loader reads `miles.quant.config` in every process, and formats.py
# imports torch (~2 s): a node daemon or the CLI must not pay that to read a recipe.
_FROM_FORMATS = ("FORMATS", "PARTS", "QuantizedTensor", "dequantize", "fake_quantize", "part_shapes",
                 "quantize")


def __getattr__(name: str):
    if name in _FROM_FORMATS:
        return getattr(importlib.import_module("miles.quant.formats"), name)
    if name in ("formats", "keep", "export", "qat", "train", "config"):
        return importlib.import_module(f"miles.quant.{name}")
    raise AttributeError(f"module 'miles.quant' has no attribute {name!r}")


__all__ = ["FORMATS", "PARTS", "QuantizedTensor", "dequantize", "fake_quantize", "part_shapes",
           "quantize"]
