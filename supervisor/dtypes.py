"""The tensor dtypes a checkpoint can hold, by their safetensors names (the format's spec)."""

from __future__ import annotations

import torch

#: Safetensors dtype names (the format's spec), by torch dtype.
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
