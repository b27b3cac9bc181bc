"""bfloat16 reductions on CuPy arrays that hold bfloat16 bits as int16.

CuPy has no bfloat16 dtype, so a bf16 CUDA tensor enters tplab as an int16 view of the same memory
(``tplab.toolkit.arrays``): the algorithms move those 16 bits as they are (half the bytes of float32, as NCCL
moves bf16) and only the reduction needs to know what they mean. Each combination does what torch and
NCCL do for one bf16 operation: widen both operands to float32 (exact: bf16 is the top half of a
float32), operate in float32, round the result to the nearest bfloat16 (ties to even; NaN stays NaN).

So a p-rank sum rounds to bf16 after every pairwise step, as NCCL's own bf16 all-reduce does; a result
is compared with NCCL's to bf16 rounding (about 2**-8 relative per step), not bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tplab.toolkit.ops import ReduceOp, get_op

_FLOAT_OF = {"sum": "a + b", "prod": "a * b",
             "max": "(a != a || a > b) ? a : b", "min": "(a != a || a < b) ? a : b"}  # NaN wins, as numpy
_PREAMBLE = r"""
__device__ float bf16_to_float(short h) {
    return __uint_as_float(((unsigned int)(unsigned short)h) << 16);
}
__device__ short float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (short)((u >> 16) | 0x0040u);  // NaN: keep it quiet
    u += 0x7fffu + ((u >> 16) & 1u);                                             // round to nearest even
    return (short)(u >> 16);
}
"""
_kernels: dict = {}


def _kernel(name: str):
    k = _kernels.get(name)
    if k is None:
        import cupy

        body = f"float a = bf16_to_float(x), b = bf16_to_float(y); z = float_to_bf16({_FLOAT_OF[name]});"
        k = _kernels[name] = cupy.ElementwiseKernel("int16 x, int16 y", "int16 z", body,
                                                    f"tplab_bf16_{name}", preamble=_PREAMBLE)
    return k


@dataclass(frozen=True)
class Bfloat16ReduceOp(ReduceOp):
    """The same op, on int16 arrays that hold bfloat16 bits (CuPy only)."""

    bfloat16 = True

    def combine(self, left, right, out):
        return _kernel(self.name)(left, right, out)

    def accumulate(self, acc, incoming):
        return _kernel(self.name)(incoming, acc, acc)

    def reduce_many(self, arrays):
        acc = arrays[0].copy()
        for a in arrays[1:]:
            _kernel(self.name)(acc, a, acc)
        return acc


def bfloat16_op(op) -> Bfloat16ReduceOp:
    base = get_op(op)
    return Bfloat16ReduceOp(base.name, base.ufunc, base.mpi_name)


def widen(bits):
    """bfloat16 bits (CuPy int16) -> float32, exactly."""
    import cupy

    return (bits.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def narrow(values):
    """float32 (CuPy) -> bfloat16 bits as int16, rounded to nearest even."""
    k = _kernels.get("narrow")
    if k is None:
        import cupy

        k = _kernels["narrow"] = cupy.ElementwiseKernel("float32 f", "int16 z", "z = float_to_bf16(f);",
                                                        "tplab_bf16_narrow", preamble=_PREAMBLE)
    return k(values)
