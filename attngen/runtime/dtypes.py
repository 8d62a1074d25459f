"""The torch element type of each element type a spec names (its `dtype`, its inputs'): one table for the
runtime's checks, the reference and test inputs, the ahead-of-time builds and the transformers integration."""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,  # a spec's dtype only (q, k, v); declared inputs cannot be fp8
}
# A spec's name of each floating-point torch type (what a spec's `dtype` may be)
SPEC_FLOAT_DTYPES: dict[torch.dtype, str] = {t: name for name, t in TORCH_DTYPES.items() if t.is_floating_point}
