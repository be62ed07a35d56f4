"""Reduction kernels (aiofabric/sched/reduce.py): GB/s of the generated C kernel against numpy's ufunc
(`np.add(a, b, out=a)`), in place (`a += b`), for float32 and float16 sums at 4 KiB, 256 KiB, 4 MiB and 64 MiB
(bytes per operand), best of N repetitions, the ratios measured in the same run.

    python bench/reduce.py [--json] [--reps 7] [--min-time 0.05] [--sizes 4096,262144,...] [--dtypes float32,float16]

GB/s counts the bytes an in-place sum moves, 3x the operand size (read a, read b, write a), over wall time. "c" calls
the C function through ctypes with its arguments prepared once (what a batch replay does); "c checked" goes through
`Reduction.__call__`, which checks the arguments on every call (what a direct call costs); "numpy" is
`np.add(a, b, out=a)`. Each repetition restores `a` from a pristine copy (not timed) and then times a loop of calls
long enough to last `--min-time` seconds; C and numpy alternate within each repetition, so a slow spell of the VM hits
both. Single-threaded: each runs on one core.
"""
import argparse
import ctypes
import json
import os
import platform
import time

import numpy as np

from aiofabric.sched import reduce as R

SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20)
DTYPES = ("float32", "float16")


def loops_for(fn, min_time):
    """Calls of `fn` that take at least `min_time` seconds (doubling from 1; measured once)."""
    count = 1
    while True:
        started = time.perf_counter()
        for _ in range(count):
            fn()
        if time.perf_counter() - started >= min_time or count >= 1 << 20:
            return count
        count *= 2


def timed(fn, count):
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - started) / count


def measure(dtype, nbytes, reps, min_time, rng):
    """Best seconds per call of each variant (and the calls per timed loop) for an in-place sum of `nbytes`-byte
    operands of `dtype`."""
    reduction = R.reduction("sum", dtype)
    if reduction.backend != "c":
        raise SystemExit("no C compiler: the C kernel cannot be built (set CC, or install gcc or clang)")
    n = nbytes // np.dtype(dtype).itemsize
    pristine = rng.standard_normal(n).astype(dtype)
    a, b = pristine.copy(), (rng.standard_normal(n) * 0.01).astype(dtype)  # small steps: a stays normal, in range
    function = reduction.kernel.function
    args = (ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(b.ctypes.data),
            ctypes.c_int64(n))
    variants = {
        "c": lambda: function(*args),
        "c checked": lambda: reduction(a, a, b),
        "numpy": lambda: np.add(a, b, out=a),
    }
    counts = {name: loops_for(fn, min_time) for name, fn in variants.items()}
    best = {name: float("inf") for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            np.copyto(a, pristine)
            best[name] = min(best[name], timed(fn, counts[name]))
    # the same answer, bit for bit (no NaN here): one C call and one numpy call from the same start
    np.copyto(a, pristine)
    variants["c"]()
    from_c = a.copy()
    np.copyto(a, pristine)
    variants["numpy"]()
    assert (from_c.view(np.uint8) == a.view(np.uint8)).all(), f"{dtype} {nbytes}: C and numpy differ"
    return best, counts


def human(nbytes):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=7, help="repetitions; the best is kept (default 7)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop (default 0.05)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per operand, comma-separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = args.dtypes.split(",")
    rng = np.random.default_rng(1)
    rows = []
    for dtype in dtypes:
        for nbytes in sizes:
            best, counts = measure(dtype, nbytes, args.reps, args.min_time, rng)
            moved = 3 * nbytes
            rows.append({"dtype": dtype, "bytes": nbytes, "elements": nbytes // np.dtype(dtype).itemsize,
                         "seconds": best, "loops": counts,
                         "gb_per_s": {name: moved / s / 1e9 for name, s in best.items()},
                         "c_over_numpy": best["numpy"] / best["c"],
                         "c_checked_over_numpy": best["numpy"] / best["c checked"]})
    kernel = R.reduction("sum", "float32").kernel
    result = {"rows": rows, "reps": args.reps, "min_time": args.min_time, "numpy": np.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(), "compiler": kernel.build["compiler"],
              "flags": kernel.build["flags"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"in-place sum a += b, best of {args.reps}, GB/s = 3 x operand bytes / time; ratio = numpy time / C time; "
          f"{kernel.build['compiler']} {' '.join(kernel.build['flags'])}, numpy {np.__version__}")
    print(f"{'dtype':8} {'size':>8} {'c GB/s':>8} {'checked':>8} {'numpy':>8} {'c/numpy':>8} {'chk/np':>7} "
          f"{'c us':>9} {'numpy us':>9}")
    for row in rows:
        g = row["gb_per_s"]
        print(f"{row['dtype']:8} {human(row['bytes']):>8} {g['c']:8.2f} {g['c checked']:8.2f} {g['numpy']:8.2f} "
              f"{row['c_over_numpy']:7.2f}x {row['c_checked_over_numpy']:6.2f}x "
              f"{row['seconds']['c'] * 1e6:9.2f} {row['seconds']['numpy'] * 1e6:9.2f}")


if __name__ == "__main__":
    main()
