"""Elementwise reductions `out[i] = a[i] OP b[i]` (the step of an all-reduce), as C kernels or numpy ufuncs.

    step = sched.reduce.reduce(acc, acc, arrived, op="sum", queue=compute)   # in place: acc += arrived

Each (op, dtype) is one generated C function, built once per process with the system compiler (`CKernel`), or, with
no compiler, the matching numpy ufunc (`Reduction.backend` says which). Both give numpy's results bit for bit, so a
batch computes the same numbers on every host whichever it got: NaN propagation and the signed-zero choice of
np.minimum/np.maximum, wrap-around of signed integers, float16 computed in float32 and rounded to nearest even.
One exception: the sum or product of two NaNs is a's NaN here, where numpy's float32/float64 loops give a's or b's
depending on the element's position (its SIMD and scalar paths differ); both are a quiet NaN of one operand.
bfloat16 is there when the ml_dtypes package is (numpy has no such type): its ufuncs compute in float32 and round to
nearest even, a NaN result being the quiet NaN of its sign (of either operand's sign, for two NaNs).
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import threading
from typing import Any

import numpy as np

from .calls import Call, ComputeQueue, kernel
from .kernels import CKernel, check_flat
from ..errors import CompilerNotFoundError

try:
    importlib.import_module("ml_dtypes")  # registers bfloat16 with numpy
    BFLOAT16: np.dtype[Any] | None = np.dtype("bfloat16")
except ImportError:  # optional (aiofabric[bf16]): without it there is no bfloat16 array to reduce
    BFLOAT16 = None

OPS = ("sum", "prod", "min", "max")
DTYPES: tuple[np.dtype[Any], ...] = (*(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64,
                                                               np.int8, np.uint8, np.uint32, np.uint64)),
                                      *([BFLOAT16] if BFLOAT16 is not None else []))
UFUNCS: dict[str, np.ufunc] = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
# -O3: GCC's -O2 (very-cheap cost model) will not version a loop for possible aliasing, so without `restrict` (out
# may be a or b) it would stay scalar. IEEE semantics are kept: no -ffast-math.
FLAGS = ("-O3", "-shared", "-fPIC")
THREAD_BYTES = 256 << 10  # from this size a reduction runs in a worker thread (C and ufuncs release the GIL)

# float16 <-> float32 in integer arithmetic: C has no portable half type (and GCC's _Float16 on x86 without
# AVX512-FP16 calls libgcc's soft-float conversions anyway). These match numpy's npy_half_to_float/npy_float_to_half,
# whose results numpy's float16 ufuncs round: the op is done in float32 and rounded once, to nearest even.
_HALF = r"""
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* Exact: every half is a float. Subnormals go through sig * 2^-24, a normal float, so FTZ/DAZ cannot touch them;
   inf and NaN keep their sign and payload. */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h & 0x7c00u, sig = h & 0x03ffu;
    if (exp == 0x7c00u) return float_of(sign | 0x7f800000u | sig << 13);
    if (exp == 0) return float_of(sign | bits_of((float)sig * 0x1p-24f));
    return float_of(sign | (((uint32_t)(h & 0x7fffu) + 0x1c000u) << 13));  /* rebias the exponent: 15 -> 127 */
}

/* Round to nearest, ties to even. A NaN keeps its sign and top 10 payload bits (and stays a NaN). */
static inline uint16_t f2h(float f) {
    uint32_t u = bits_of(f), sign = (u >> 16) & 0x8000u, x = u & 0x7fffffffu;
    if (x >= 0x7f800000u) {
        uint32_t payload = (x & 0x007fffffu) >> 13;
        return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u && payload == 0 ? 1u : payload));
    }
    if (x >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);   /* >= 65536: inf */
    if (x >= 0x38800000u) {                                      /* a normal half: drop 13 bits, rounded; the */
        x += 0x0fffu + ((x >> 13) & 1u);                         /* carry may bump the exponent, up to inf */
        return (uint16_t)(sign | ((x - 0x38000000u) >> 13));
    }
    if (x < 0x33000000u) return (uint16_t)sign;                  /* < 2^-25 (or a tie at it): zero */
    {                                                            /* a subnormal half: count 2^-24 units */
        uint32_t e = x >> 23, m = (x & 0x007fffffu) | 0x00800000u, shift = 126 - e;
        uint32_t h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        h += rest > half || (rest == half && (h & 1u));
        return (uint16_t)(sign | h);
    }
}
"""

# bfloat16 <-> float32: a bfloat16 is a float's top half. ml_dtypes rounds to nearest even, and makes a NaN the quiet
# NaN of its sign (its min and max return an operand, NaN payload and all, as these do).
_BFLOAT = r"""
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float b2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint16_t f2b(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  /* the carry may bump the exponent, up to inf */
}
"""

# (C element type, expression of x = a[i] and y = b[i]) per dtype and op.
# Signed sum/prod run on the unsigned type of the same width: they wrap as numpy's do, where signed overflow would
# be undefined behaviour in C. Float min/max are np.minimum/np.maximum's: a NaN in a wins, then a NaN in b, and for
# equal operands (0.0 and -0.0) float32/float64 return y but float16 returns x (numpy's HALF loop compares with <=).
_FLOAT_OPS = {"sum": "x + y", "prod": "x * y", "min": "(x < y || x != x) ? x : y", "max": "(x > y || x != x) ? x : y"}
_C_OPS: dict[str, dict[str, tuple[str, str]]] = {
    "float32": {op: ("float", expr) for op, expr in _FLOAT_OPS.items()},
    "float64": {op: ("double", expr) for op, expr in _FLOAT_OPS.items()},
    **{name: {"sum": (f"uint{bits}_t", "x + y"), "prod": (f"uint{bits}_t", "x * y"),
              "min": (f"int{bits}_t", "x < y ? x : y"), "max": (f"int{bits}_t", "x > y ? x : y")}
       for name, bits in (("int8", 8), ("int32", 32), ("int64", 64))},
    **{f"uint{bits}": {op: (f"uint{bits}_t", expr) for op, expr in (("sum", "x + y"), ("prod", "x * y"),
                                                                   ("min", "x < y ? x : y"), ("max", "x > y ? x : y"))}
       for bits in (8, 32, 64)},
    "float16": {"sum": ("uint16_t", "f2h(h2f(x) + h2f(y))"), "prod": ("uint16_t", "f2h(h2f(x) * h2f(y))"),
                "min": ("uint16_t", "(h2f(x) <= h2f(y) || h2f(x) != h2f(x)) ? x : y"),
                "max": ("uint16_t", "(h2f(x) >= h2f(y) || h2f(x) != h2f(x)) ? x : y")},
    "bfloat16": {"sum": ("uint16_t", "f2b(b2f(x) + b2f(y))"), "prod": ("uint16_t", "f2b(b2f(x) * b2f(y))"),
                 "min": ("uint16_t", "(b2f(x) < b2f(y) || b2f(x) != b2f(x)) ? x : y"),
                 "max": ("uint16_t", "(b2f(x) > b2f(y) || b2f(x) != b2f(x)) ? x : y")},
}


def function_name(op: str, dtype: np.dtype[Any]) -> str:
    return f"aiofabric_{op}_{dtype.name}"


def c_source(op: str, dtype: Any) -> str:
    """The C source of `out[i] = a[i] OP b[i]` for one op and dtype. No `restrict`: out may be a or b (in place)."""
    op, dtype = _check_op(op, "c_source"), _check_dtype(dtype, "c_source")
    ctype, expr = _C_OPS[dtype.name][op]
    return (f"/* aiofabric.sched.reduce: out[i] = a[i] {op} b[i] for {dtype.name}, bit for bit numpy's "
            f"np.{UFUNCS[op].__name__} */\n#include <stdint.h>\n#include <string.h>\n"
            + {"float16": _HALF, "bfloat16": _BFLOAT}.get(dtype.name, "")
            + f"\nvoid {function_name(op, dtype)}({ctype} *out, const {ctype} *a, const {ctype} *b, int64_t n) {{\n"
            f"    for (int64_t i = 0; i < n; i++) {{\n        {ctype} x = a[i], y = b[i];\n"
            f"        out[i] = {expr};\n    }}\n}}\n")


@dataclasses.dataclass(frozen=True, eq=False)
class Reduction:
    """What computes `out[i] = a[i] OP b[i]` for one op and dtype: `kernel` (a CKernel) when `backend == "c"`, else
    `ufunc` alone (`backend == "numpy"`, no C compiler). Calling it runs it now, after the same checks as reduce()."""
    op: str
    dtype: np.dtype[Any]
    backend: str  # "c" or "numpy"
    kernel: CKernel | None
    ufunc: np.ufunc

    def __call__(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        name = f"reduce {self.op}"
        check_arguments(out, a, b, name)
        if out.dtype != self.dtype:
            raise ValueError(f"{name}: the arrays are {out.dtype}; this reduction is for {self.dtype}")
        if self.kernel is not None:
            self.kernel.function(*(ctypes.c_void_p(x.ctypes.data) for x in (out, a, b)), ctypes.c_int64(out.size))
        else:
            with np.errstate(all="ignore"):  # silent, as the C kernels are (inf - inf is nan, not a warning)
                self.ufunc(a, b, out=out)

    def __repr__(self) -> str:
        return f"Reduction({self.op!r}, {self.dtype.name}, backend={self.backend!r})"


_cache: dict[tuple[str, np.dtype[Any]], Reduction] = {}
_cache_lock = threading.Lock()


def reduction(op: str, dtype: Any) -> Reduction:
    """The reduction for `op` and `dtype`, built on first use and kept for the process (a replay or a second batch
    never compiles again; a new process finds the library in the kernel cache). With no C compiler it is the numpy
    ufunc, and stays so for the process: `clear_cache()` forgets the choice."""
    op, dtype = _check_op(op, "reduction"), _check_dtype(dtype, "reduction")
    key = (op, dtype)
    with _cache_lock:  # one build per key, even when two threads ask at once
        found = _cache.get(key)
        if found is None:
            try:
                built = CKernel(c_source(op, dtype), function_name(op, dtype), flags=FLAGS)
                found = Reduction(op, dtype, "c", built, UFUNCS[op])
            except CompilerNotFoundError:  # a KernelBuildError is a real fault: it propagates
                found = Reduction(op, dtype, "numpy", None, UFUNCS[op])
            _cache[key] = found
    return found


def clear_cache() -> None:
    """Forget every reduction built in this process (the next `reduction()` looks for a compiler again)."""
    with _cache_lock:
        _cache.clear()


def reduce(out: np.ndarray, a: np.ndarray, b: np.ndarray, *, op: str = "sum", queue: ComputeQueue,
           name: str | None = None) -> Call:
    """A kernel call `out[i] = a[i] OP b[i]` on `queue`; `reduce(x, x, y)` is in place. The arrays are 0-d or 1-d,
    C-contiguous (the C kernel gets base pointers: a strided view would be read wrong), of one shape and one
    supported dtype; out is writable, and is a, b or memory of its own (a shifted overlap would read elements already
    written, unlike numpy). Each refusal names the argument. The call's name says the backend, so describe() shows
    whether C or numpy runs it."""
    label = name or f"reduce {op}"
    op = _check_op(op, label)
    check_arguments(out, a, b, label)
    found = reduction(op, out.dtype)
    name = name or f"reduce {op} {found.dtype.name} ({found.backend})"
    threaded = out.nbytes >= THREAD_BYTES  # below, the hop to a worker thread costs more than the work
    if found.kernel is not None:
        return kernel(found.kernel, [out], [a, b], [out.size], queue=queue, name=name, threaded=threaded)
    ufunc = found.ufunc

    def apply(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            ufunc(a, b, out=out)
    return kernel(apply, [out], [a, b], queue=queue, name=name, threaded=threaded)


def check_arguments(out: Any, a: Any, b: Any, name: str) -> None:
    """Refuse, naming the argument, what the kernel would get wrong: see reduce()."""
    arrays = {"out": out, "a": a, "b": b}
    for label, array in arrays.items():
        check_flat(array, name, label)
        _check_dtype(array.dtype, f"{name}: argument {label}")
    for label, array in arrays.items():
        if array.dtype != out.dtype:
            raise ValueError(f"{name}: dtype mismatch: out is {out.dtype}, {label} is {array.dtype}")
        if array.shape != out.shape:
            raise ValueError(f"{name}: shape mismatch: out has shape {out.shape}, {label} has {array.shape}")
    for label, array in arrays.items():
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: argument {label} is not contiguous (strides {array.strides}); the kernel reads "
                             "from its base pointer: pass np.ascontiguousarray(x), or a copy")
    if not out.flags.writeable:
        raise ValueError(f"{name}: argument out is read-only")
    for label in ("a", "b"):
        array = arrays[label]
        if array.ctypes.data != out.ctypes.data and out.size and np.may_share_memory(out, array):
            raise ValueError(f"{name}: out partly overlaps {label}; in place means the same memory (reduce(x, x, y)), "
                             "anything else must not overlap out")


def _check_op(op: Any, name: str) -> str:
    if op not in OPS:
        raise ValueError(f"{name}: unknown op {op!r}; the ops are {', '.join(OPS)}")
    return str(op)


def _check_dtype(dtype: Any, name: str) -> np.dtype[Any]:
    try:
        found = np.dtype(dtype) if dtype is not None else None  # np.dtype(None) would be float64
    except TypeError:
        found = None
    if found is None or found not in DTYPES:  # a byte-swapped dtype is refused too: the kernels read native order
        raise TypeError(f"{name}: unsupported dtype {found if found is not None else dtype!r}; reductions take "
                        f"{', '.join(d.name for d in DTYPES)} (native byte order)")
    assert found is not None
    return found


__all__ = ["DTYPES", "OPS", "Reduction", "c_source", "clear_cache", "reduce", "reduction"]
