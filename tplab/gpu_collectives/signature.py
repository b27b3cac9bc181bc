"""A collective call's arguments in 64 bits, compared on the GPU instead of by a host all-gather.

Every collective call on peer memory starts with the ranks' kernels swapping signatures (agree in
kernels/agreement.cuh). The low 32 bits are the element count, the next 8 the element type, so that an error
can say what the other rank passed; the top 24 bits hash the rest (collective, shape, op, algorithm, root).
0 is never a signature (it tells a kernel that the call agreed already), nor is REFUSED (all ones: "this
rank's input is bad; it only came to say so").
"""

from __future__ import annotations

import math
import zlib

REFUSED = (1 << 64) - 1
AGREED_ALREADY = 0
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128")
OTHER = 255


def signature(description: dict) -> int:
    """The signature of a call described as tplab.collectives describes it (collective, shape, dtype, op,
    algorithm, root; problems make it REFUSED)."""
    if description.get("problems"):
        return REFUSED
    shape = description.get("shape")
    count = math.prod(shape) if shape is not None else 0
    dtype = str(description.get("dtype"))
    code = DTYPES.index(dtype) if dtype in DTYPES else OTHER
    rest = repr(tuple(sorted((k, repr(v)) for k, v in description.items() if k not in ("dtype", "problems"))))
    digest = (zlib.crc32(rest.encode()) & 0x7FFFFF) | 0x800000   # top bit set: never 0
    return (digest << 40) | (code << 32) | (count & 0xFFFFFFFF)


def describe(sig: int) -> str:
    """What a signature says in words: '1024 x bfloat16', or that the rank refused its input."""
    if sig == REFUSED:
        return "input it refused (its own error says why)"
    code = (sig >> 32) & 0xFF
    dtype = DTYPES[code] if code < len(DTYPES) else "another type"
    return f"{sig & 0xFFFFFFFF} x {dtype}"
