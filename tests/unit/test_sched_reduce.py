"""Elementwise reductions (aiofabric/sched/reduce.py): numpy's bits on the C and the numpy backend, for every op and
dtype (NaN payloads, signed zeros, subnormals, float16 ties, integer wrap-around), in place and out of place, at
sizes 0 to 1M; the refusals; a reduce call replayed in a batch with rebound inputs; the per-process cache. Two
tampered kernels show the bit comparison fails when a kernel is wrong."""
import os
import re
import shutil
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric import sched
from aiofabric.sched import reduce as R

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CASES = [pytest.param(op, dtype, id=f"{op}-{dtype.name}") for op in R.OPS for dtype in R.DTYPES]
NO_CC = "aiofabric-test-no-such-cc"
HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: only the numpy backend exists here")
# the reference (numpy's own ufuncs) warns on overflow and inf - inf; the reductions must not
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# -- the comparison ---------------------------------------------------------------------------------------------------
def bits(x):
    return x.view(UINT[x.dtype.itemsize])


def numpy_result(op, a, b):
    with np.errstate(all="ignore"):
        return np.asarray(R.UFUNCS[op](a, b))  # a 0-d array, not a scalar, from 0-d operands


def assert_same_bits(got, want, a, b, op):
    """`got` is `want` bit for bit: NaN payloads and signs, signed zeros. One exception, a sum or product of two NaNs:
    numpy itself is not consistent there (its SIMD body returns a's NaN, the scalar tail after the last full vector,
    where the compiler swapped the operands, b's: np.add(a, b) of float32 arrays of 17 NaNs differs at index 16), so
    its result there must be one of the two operands' NaNs, quieted, no more."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = bits(got), bits(want)
    wrong = g != w
    if got.dtype.kind == "f" and op in ("sum", "prod"):
        quiet = UINT[got.dtype.itemsize](1 << (np.finfo(got.dtype).nmant - 1))
        both = np.isnan(a) & np.isnan(b)
        wrong &= ~(both & ((g == (bits(a) | quiet)) | (g == (bits(b) | quiet))))
    if got.dtype == R.BFLOAT16 and op in ("sum", "prod"):  # ml_dtypes: the quiet NaN of one operand's sign
        both = np.isnan(a) & np.isnan(b)
        wrong &= ~(both & ((g == (bits(a) & 0x8000 | 0x7FC0)) | (g == (bits(b) & 0x8000 | 0x7FC0))))
    if wrong.any():
        at = np.flatnonzero(np.atleast_1d(wrong))
        width = got.dtype.itemsize * 2 + 2

        def word(x, i):
            return f"{int(np.atleast_1d(x)[i]):#0{width}x}"
        shown = "; ".join(f"[{i}] a={word(bits(a), i)} b={word(bits(b), i)} numpy={word(w, i)} got={word(g, i)}"
                          for i in at[:5])
        raise AssertionError(f"{op} {got.dtype}: {len(at)} of {got.size} elements differ from numpy: {shown}")


def check(reduction, a, b):
    """Run `reduction` out of place, in place on a (reduce(x, x, y)) and in place on b, against numpy each time."""
    want = numpy_result(reduction.op, a, b)
    out = np.full_like(a, 7)
    reduction(out, a, b)
    assert_same_bits(out, want, a, b, reduction.op)
    x = a.copy()
    reduction(x, x, b)
    assert_same_bits(x, want, a, b, reduction.op)
    y = b.copy()
    reduction(y, a, y)
    assert_same_bits(y, want, a, b, reduction.op)


# -- the data ---------------------------------------------------------------------------------------------------------
def nan(dtype, payload, *, negative=False, quiet=True):
    """The NaN of `dtype` with these low mantissa bits, quiet (top mantissa bit set) or signalling, of either sign."""
    info = np.finfo(dtype)
    word = int(bits(np.array(np.inf, dtype))) | payload | (quiet << (info.nmant - 1)) | (negative << (info.bits - 1))
    return np.array(word, UINT[info.dtype.itemsize]).view(info.dtype)[()]


def specials(dtype):
    """Every value an op treats apart: ±0, ±inf, quiet and signalling NaNs with payloads and both signs, the largest
    and smallest normals and subnormals, a few plain numbers; integer extremes and their neighbours."""
    dtype = np.dtype(dtype)
    if dtype.kind == "u":
        info = np.iinfo(dtype)
        return np.array([0, 1, 2, 3, info.max, info.max - 1, 1 << (info.bits // 2), info.max // 2 + 1], dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return np.array([0, 1, -1, 2, -2, 3, info.max, info.min, info.max - 1, info.min + 1, 1 << (info.bits // 2),
                         -(1 << (info.bits // 2)), info.max // 2 + 1], dtype)
    info = np.finfo(dtype)
    nans = np.array([nan(dtype, 0), nan(dtype, 5), nan(dtype, 1, quiet=False), nan(dtype, 3, quiet=False),
                     nan(dtype, 9, negative=True), nan(dtype, 7, negative=True, quiet=False),
                     nan(dtype, 1 << (info.nmant - 2), quiet=False)], dtype)
    values = np.array([0.0, -0.0, np.inf, -np.inf, info.max, -info.max, info.tiny, -info.tiny,
                       info.smallest_subnormal, -info.smallest_subnormal, info.smallest_subnormal * 3,
                       info.tiny - info.smallest_subnormal, 1.0, -1.0, 0.5, 1.5, 3.0, -7.25, info.eps, 1 + info.eps],
                      dtype)
    return np.concatenate([values, nans])


def random_values(dtype, n, rng):
    """A mix: uniformly random bit patterns (every NaN payload, subnormal, extreme), the specials, and ordinary
    numbers (normal floats, small integers, so sums and products land in range too)."""
    dtype = np.dtype(dtype)
    uint = UINT[dtype.itemsize]
    raw = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True).view(dtype)
    pool = specials(dtype)
    picked = pool[rng.integers(0, len(pool), n)]
    if dtype.kind == "f":
        plain = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(dtype)
    else:
        plain = rng.integers(-1000, 1000, n).astype(dtype)
    which = rng.integers(0, 3, n)
    return np.where(which == 0, raw, np.where(which == 1, picked, plain))


def every_pair(dtype):
    pool = specials(dtype)
    return np.repeat(pool, len(pool)), np.tile(pool, len(pool))


@pytest.fixture(params=["c", "numpy"])
def backend(request, monkeypatch):
    """Reductions built during the test use this backend: "numpy" hides the compiler (CC names none). The cache is
    cleared before and after, so no other test sees the choice."""
    if request.param == "numpy":
        monkeypatch.setenv("CC", NO_CC)
    elif not HAVE_CC:
        pytest.skip("no C compiler")
    R.clear_cache()
    yield request.param
    monkeypatch.undo()
    R.clear_cache()


# -- bit for bit numpy ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op, dtype", CASES)
def test_every_op_and_dtype_gives_numpys_bits_on_specials_and_random_data(op, dtype):
    reduction = R.reduction(op, dtype)
    assert reduction.backend == ("c" if HAVE_CC else "numpy")
    check(reduction, *every_pair(dtype))  # every pair of specials: inf - inf, 0 * inf, min(0, -0), max + 1, ...
    rng = np.random.default_rng(zlib.crc32(f"{op} {dtype.name}".encode()))
    n = 4099  # odd: the vector loop's body and its scalar tail
    a, b = random_values(dtype, n + 3, rng), random_values(dtype, n + 3, rng)
    check(reduction, a[:n], b[:n])
    check(reduction, a[1:n + 1], b[3:n + 3])  # starts off any vector alignment, and a different one for a and b
    for size in (0, 1, 2, 3, 15, 16, 17, 31, 33, 63, 65):  # around every vector width (16..64 bytes)
        check(reduction, a[:size].copy(), b[:size].copy())
    check(reduction, np.array(a[0]), np.array(b[0]))  # 0-d


@needs_cc
@pytest.mark.parametrize("op, dtype", CASES)
def test_the_numpy_backend_gives_the_c_backends_bits(op, dtype, monkeypatch):
    c = R.reduction(op, dtype)
    rng = np.random.default_rng(7)
    a, b = np.concatenate([every_pair(dtype)[0], random_values(dtype, 3001, rng)]), \
        np.concatenate([every_pair(dtype)[1], random_values(dtype, 3001, rng)])
    from_c = np.empty_like(a)
    c(from_c, a, b)
    monkeypatch.setenv("CC", NO_CC)
    R.clear_cache()
    try:
        fallback = R.reduction(op, dtype)
        assert fallback.backend == "numpy" and fallback.kernel is None and c.backend == "c"
        assert repr(fallback) == f"Reduction({op!r}, {dtype.name}, backend='numpy')"
        from_numpy = np.empty_like(a)
        fallback(from_numpy, a, b)
        assert_same_bits(from_c, from_numpy, a, b, op)
        in_place = a.copy()
        fallback(in_place, in_place, b)
        assert_same_bits(in_place, from_c, a, b, op)
    finally:
        monkeypatch.undo()
        R.clear_cache()
    assert R.reduction(op, dtype).backend == "c"


def test_integer_sums_and_products_wrap_around_as_numpys_do():
    for dtype in (np.uint8, np.uint32, np.uint64):  # modulo 2^bits
        info = np.iinfo(dtype)
        a, b = np.array([info.max, 1 << (info.bits - 1)], dtype), np.array([2, 2], dtype)
        total, product = np.empty_like(a), np.empty_like(a)
        R.reduction("sum", dtype)(total, a, b)
        R.reduction("prod", dtype)(product, a, b)
        assert total.tolist() == [1, (1 << (info.bits - 1)) + 2] and product.tolist() == [info.max - 1, 0]
    for dtype in (np.int8, np.int32, np.int64):
        info = np.iinfo(dtype)
        a, b = np.array([info.max, info.min, info.min, info.max], dtype), np.array([1, -1, -1, info.max], dtype)
        total, product = np.empty_like(a), np.empty_like(a)
        R.reduction("sum", dtype)(total, a, b)
        R.reduction("prod", dtype)(product, a, b)
        assert total.tolist() == [info.min, info.max, info.max, -2]
        assert product.tolist() == [info.max, info.min, info.min, 1]


def test_min_and_max_propagate_nans_and_choose_signed_zeros_as_numpy_does():
    """Written out, not only compared: a NaN in a wins, then b's; for 0.0 and -0.0 float32/float64 give b, float16
    gives a."""
    for dtype in (np.float16, np.float32, np.float64):
        first, second = nan(dtype, 9, negative=True), nan(dtype, 7, quiet=False)  # a's quiet, b's signalling
        a = np.array([first, 1.0, first, 0.0, -0.0], dtype)
        b = np.array([2.0, second, second, -0.0, 0.0], dtype)
        for op in ("min", "max"):
            out = np.empty_like(a)
            R.reduction(op, dtype)(out, a, b)
            zeros_from = a if dtype is np.float16 else b
            assert bits(out).tolist() == [bits(a)[0], bits(b)[1], bits(a)[2], bits(zeros_from)[3], bits(zeros_from)[4]]


def test_a_sum_or_product_of_two_nans_is_one_of_them_quieted_at_every_position():
    """Where numpy is not consistent (see assert_same_bits), the kernel still gives one answer at every index."""
    for dtype in (np.float16, np.float32, np.float64):
        a, b = np.full(1000, nan(dtype, 5), dtype), np.full(1000, nan(dtype, 3, negative=True, quiet=False), dtype)
        for op in ("sum", "prod"):
            out = np.empty_like(a)
            R.reduction(op, dtype)(out, a, b)
            assert len(set(bits(out).tolist())) == 1 and np.isnan(out).all()
            assert_same_bits(out, numpy_result(op, a, b), a, b, op)


# -- float16 ----------------------------------------------------------------------------------------------------------
ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def float16_ties():
    """(a, b) whose exact float32 sum lies halfway between two neighbouring halves: a finite half of either sign
    (exponent >= -13, so half its ulp is a half) plus half its ulp or 1.5 ulps, of its sign; and every odd subnormal
    times ±0.5. Rounding to even makes the result's last bit 0."""
    h = ALL_HALVES[np.isfinite(ALL_HALVES) & (np.abs(ALL_HALVES) >= np.float16(2.0 ** -13))]
    ulp = np.spacing(np.abs(h).astype(np.float32)).astype(np.float32)  # float32's spacing; the half's is 2^13 times
    half_ulp = (ulp * 2.0 ** 12).astype(np.float16) * np.sign(h)
    sums = (np.concatenate([h, h]), np.concatenate([half_ulp, (half_ulp.astype(np.float32) * 3).astype(np.float16)]))
    subnormal = ALL_HALVES[((bits(ALL_HALVES) & 0x7c00) == 0) & (bits(ALL_HALVES) & 1 == 1)]  # odd: k/2 is a tie
    products = (np.concatenate([subnormal, subnormal]),
                np.concatenate([np.full(len(subnormal), 0.5, np.float16), np.full(len(subnormal), -0.5, np.float16)]))
    return sums, products


def test_float16_ties_round_to_even():
    (a, b), (c, d) = float16_ties()
    for op, x, y in (("sum", a, b), ("prod", c, d)):
        exact = x.astype(np.float64) + y.astype(np.float64) if op == "sum" else x.astype(np.float64) * y
        with np.errstate(over="ignore"):
            nearest = exact.astype(np.float16)  # numpy's cast from float64, not the ufunc under test
        out = np.empty_like(x)
        R.reduction(op, np.float16)(out, x, y)
        assert_same_bits(out, numpy_result(op, x, y), x, y, op)
        finite = np.isfinite(out)
        assert finite.sum() > len(x) * 0.9 and (bits(out)[finite] & 1 == 0).all(), "a tie rounded to odd"
        assert (np.abs(out.astype(np.float64) - exact) == np.abs(nearest.astype(np.float64) - exact))[finite].all()


def test_float16_every_first_operand_against_a_sample_of_second_operands():
    """All 65536 bit patterns of a against 48 random patterns of b and ±0.5, ±1, ±2^-14 (float16 computed in
    float32 and rounded once, subnormal results, overflow to inf)."""
    rng = np.random.default_rng(16)
    sample = np.concatenate([rng.integers(0, 1 << 16, 48).astype(np.uint16).view(np.float16),
                             np.array([0.5, -0.5, 1.0, -1.0, 2.0 ** -14, -(2.0 ** -14)], np.float16)])
    a, b = np.tile(ALL_HALVES, len(sample)), np.repeat(sample, len(ALL_HALVES))
    for op in R.OPS:
        out = np.empty_like(a)
        R.reduction(op, np.float16)(out, a, b)
        assert_same_bits(out, numpy_result(op, a, b), a, b, op)


@settings(max_examples=150, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 0xffff), st.integers(0, 0xffff)), min_size=1, max_size=40),
       op=st.sampled_from(R.OPS))
def test_float16_any_pairs_of_bit_patterns(pairs, op):
    a = np.array([p[0] for p in pairs], np.uint16).view(np.float16)
    b = np.array([p[1] for p in pairs], np.uint16).view(np.float16)
    check(R.reduction(op, np.float16), a, b)


# -- the checks can fail ----------------------------------------------------------------------------------------------
@needs_cc
@pytest.mark.parametrize("op, dtype, right, wrong, data", [
    # min with the NaN rule on the other operand (b's NaN wins, and a on equal): NaN pairs and ±0 come out wrong
    ("min", "float32", "(x < y || x != x) ? x : y", "(y < x || y != y) ? y : x", "pairs"),
    # float16 rounding half up instead of to even
    ("sum", "float16", "x += 0x0fffu + ((x >> 13) & 1u);", "x += 0x1000u;", "ties"),
])
def test_a_tampered_kernel_is_caught_by_the_bit_comparison(op, dtype, right, wrong, data):
    dtype = np.dtype(dtype)
    source = R.c_source(op, dtype)
    assert source.count(right) == 1
    tampered = R.Reduction(op, dtype, "c", sched.CKernel(source.replace(right, wrong), R.function_name(op, dtype),
                                                         flags=R.FLAGS), R.UFUNCS[op])
    a, b = every_pair(dtype) if data == "pairs" else float16_ties()[0]
    check(R.reduction(op, dtype), a, b)  # the real kernel passes on this data
    with pytest.raises(AssertionError, match=rf"{op} {dtype.name}: \d+ of {a.size} elements differ from numpy"):
        check(tampered, a, b)


def test_the_nan_exception_is_narrow():
    """Two NaNs summed may give either one, quieted: not a third NaN, not the signalling one as it was, not a number;
    and min and max get no exception at all."""
    def floats(*words):
        return np.array(words, np.uint32).view(np.float32)
    a, b = floats(0x7fc00000, 0x3f800000), floats(0x7f800001, 0)  # (quiet NaN, 1.0) + (signalling NaN, 0.0)
    want = numpy_result("sum", a, b)
    for either in (0x7fc00000, 0x7fc00001):  # a's, or b's quieted
        assert_same_bits(floats(either, 0x3f800000), want, a, b, "sum")
    for wrong in (0x7fc00002, 0x7f800001, 0xffc00000, 0x3f800000):
        with pytest.raises(AssertionError, match="sum float32: 1 of 2 elements differ"):
            assert_same_bits(floats(wrong, 0x3f800000), want, a, b, "sum")
    with pytest.raises(AssertionError, match="min float32: 1 of 1 elements differ"):
        assert_same_bits(floats(0x7fc00001), numpy_result("min", a[:1], b[:1]), a[:1], b[:1], "min")


def test_the_numpy_backend_is_as_silent_as_the_c_backend(monkeypatch):
    a = np.array([np.inf, 3e38], np.float32)
    b = np.array([-np.inf, 3e38], np.float32)
    monkeypatch.setenv("CC", NO_CC)
    R.clear_cache()
    try:
        out = np.empty_like(a)
        with np.errstate(all="raise"):
            R.reduction("sum", np.float32)(out, a, b)
        assert np.isnan(out[0]) and out[1] == np.inf
    finally:
        monkeypatch.undo()
        R.clear_cache()


# -- refusals ---------------------------------------------------------------------------------------------------------
def test_each_refusal_names_the_argument():
    queue = sched.ComputeQueue()
    x, y = np.zeros(8, np.float32), np.ones(8, np.float32)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    refused = [
        (lambda: R.reduce(x, x, y, op="mean", queue=queue), ValueError,
         "reduce mean: unknown op 'mean'; the ops are sum, prod, min, max"),
        (lambda: R.reduce(x.astype(np.uint16), x.astype(np.uint16), x.astype(np.uint16), queue=queue), TypeError,
         "reduce sum: argument out: unsupported dtype"),
        (lambda: R.reduce(x.astype(">f4"), x, y, queue=queue), TypeError,
         r"reduce sum: argument out: unsupported dtype dtype\('>f4'\).*\(native byte order\)"),
        (lambda: R.reduce(x, x, y.astype(">f4"), queue=queue), TypeError, "reduce sum: argument b: unsupported dtype"),
        (lambda: R.reduce(x, x.astype(np.complex64), y, queue=queue), TypeError,
         "reduce sum: argument a: unsupported dtype"),
        (lambda: R.reduce(x, x, y.astype(np.float64), queue=queue), ValueError,
         "reduce sum: dtype mismatch: out is float32, b is float64"),
        (lambda: R.reduce(x, x.astype(np.float16), y, op="max", queue=queue), ValueError,
         "reduce max: dtype mismatch: out is float32, a is float16"),
        (lambda: R.reduce(x, x, y[:4], queue=queue), ValueError,
         r"reduce sum: shape mismatch: out has shape \(8,\), b has \(4,\)"),
        (lambda: R.reduce(x, x.reshape(2, 4), y, queue=queue), ValueError, "reduce sum: argument a is 2-d"),
        (lambda: R.reduce(x[:4], x[:4], np.zeros(8, np.float32)[::2], queue=queue), ValueError,
         r"reduce sum: argument b is not contiguous \(strides \(8,\)\)"),
        (lambda: R.reduce(np.zeros(16, np.float32)[::2], x, y, queue=queue), ValueError,
         "reduce sum: argument out is not contiguous"),
        (lambda: R.reduce(frozen, x, y, queue=queue), ValueError, "reduce sum: argument out is read-only"),
        (lambda: R.reduce(x[1:5], x[0:4], y[:4], queue=queue), ValueError, "reduce sum: out partly overlaps a"),
        (lambda: R.reduce(y[0:4], x[0:4], y[1:5], op="prod", queue=queue), ValueError,
         "reduce prod: out partly overlaps b"),
        (lambda: R.reduce(x[0:4], x[2:6], y[:4], queue=queue, name="step 3"), ValueError,
         "step 3: out partly overlaps a"),
        (lambda: R.reduce([0.0], x, y, queue=queue), TypeError, "reduce sum: argument out is a list"),
        (lambda: R.reduce(x, x, y, queue=sched.CopyQueue()), TypeError, "kernels run on a ComputeQueue"),
        (lambda: R.reduction("avg", np.float32), ValueError, "reduction: unknown op 'avg'"),
        (lambda: R.reduction("sum", np.uint16), TypeError, "reduction: unsupported dtype dtype\\('uint16'\\)"),
        (lambda: R.reduction("sum", ">i8"), TypeError, "reduction: unsupported dtype dtype\\('>i8'\\)"),
        (lambda: R.reduction("sum", None), TypeError, "reduction: unsupported dtype None"),  # not float64
        (lambda: R.reduction("sum", "no such type"), TypeError, "reduction: unsupported dtype 'no such type'"),
        (lambda: R.c_source("sum", np.int16), TypeError, "c_source: unsupported dtype"),
        (lambda: R.reduction("sum", np.float64)(x, x, y), ValueError,
         "reduce sum: the arrays are float32; this reduction is for float64"),
        (lambda: R.reduction("min", np.float32)(x[1:5], x[0:4], y[:4]), ValueError,
         "reduce min: out partly overlaps a"),
    ]
    for make, error, message in refused:
        with pytest.raises(error, match=message):
            make()
    # what is allowed: in place on a or on b, a and b the same or overlapping each other, 0-d, empty
    for out, a, b in ((x, x, y), (y, x, y), (x[:4], y[:4], y[:4]), (x[:4], y[:4], y[1:5]), (x[:0], x[1:1], x[2:2]),
                      (np.zeros((), np.float32), np.ones((), np.float32), np.ones((), np.float32))):
        R.reduce(out, a, b, queue=queue)


# -- in a batch -------------------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_reduce_in_a_batch_replays_with_rebound_inputs(backend):
    c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
    rng = np.random.default_rng(3)
    acc, arrived = rng.standard_normal(1001).astype(np.float32), rng.standard_normal(1001).astype(np.float32)
    floor, peak = np.zeros(1001, np.float32), np.zeros(1001, np.float32)
    step = R.reduce(acc, acc, arrived, queue=c0)  # acc += arrived, in place
    clip = R.reduce(peak, acc, floor, op="max", queue=c1, name="clip")  # another queue: ordered by acc's memory
    assert step.name == f"reduce sum float32 ({backend})" and clip.name == "clip"
    batch = sched.compile([step, clip], inputs={"acc": acc, "arrived": arrived})
    assert f"reduce sum float32 ({backend})" in batch.describe()
    first_acc, first_arrived = acc.copy(), arrived.copy()
    await batch.run()
    want = first_acc + first_arrived
    assert_same_bits(acc, want, first_acc, first_arrived, "sum")
    assert_same_bits(peak, np.maximum(want, floor), want, floor, "max")

    acc2, arrived2 = rng.standard_normal(1001).astype(np.float32), rng.standard_normal(1001).astype(np.float32)
    second_acc, second_arrived, kept = acc2.copy(), arrived2.copy(), acc.copy()
    await batch.run({"acc": acc2, "arrived": arrived2})
    want2 = second_acc + second_arrived
    assert_same_bits(acc2, want2, second_acc, second_arrived, "sum")
    assert_same_bits(peak, np.maximum(want2, floor), want2, floor, "max")
    assert (bits(acc) == bits(kept)).all() and batch.runs == 2  # the first input was not touched again

    await batch.run({"arrived": arrived2})  # as bound already: acc2 accumulates arrived2 once more
    assert_same_bits(acc2, want2 + second_arrived, want2, second_arrived, "sum")


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("n", [0, 1, 7, 1 << 20])
async def test_sizes_from_empty_to_a_million_in_a_batch(backend, n):
    """1M float32 and float16 elements (4 MiB, 2 MiB): a reduction runs in a worker thread from 256 KiB on (on
    either backend), smaller ones inline."""
    queue = sched.ComputeQueue()
    rng = np.random.default_rng(n)
    arrays = {dtype: (random_values(dtype, n, rng), random_values(dtype, n, rng)) for dtype in ("float32", "float16")}
    before = {dtype: (a.copy(), b.copy()) for dtype, (a, b) in arrays.items()}
    out16 = np.empty(n, np.float16)
    calls = [R.reduce(arrays["float32"][0], arrays["float32"][0], arrays["float32"][1], queue=queue),
             R.reduce(out16, *arrays["float16"], op="prod", queue=queue)]
    for call in calls:
        assert call.options["c"] is (backend == "c") and call.options["threaded"] is (n == 1 << 20)
    await sched.compile(calls).run()
    a, b = before["float32"]
    assert_same_bits(arrays["float32"][0], numpy_result("sum", a, b), a, b, "sum")
    a, b = before["float16"]
    assert_same_bits(out16, numpy_result("prod", a, b), a, b, "prod")


# -- the cache --------------------------------------------------------------------------------------------------------
def test_a_reduction_is_built_once_per_process(monkeypatch):
    first = R.reduction("sum", np.float32)
    assert R.reduction("sum", "float32") is first and R.reduction("sum", np.dtype("<f4")) is first
    assert R.reduction("max", np.float32) is not first and R.reduction("sum", np.float64) is not first
    builds = []
    real = R.CKernel

    def counting(*args, **kwargs):  # slow: eight threads asking at once would all build without the lock
        builds.append(args[1])
        time.sleep(0.05)
        return real(*args, **kwargs)
    monkeypatch.setattr(R, "CKernel", counting)
    R.clear_cache()
    try:
        found, barrier = [], threading.Barrier(8)

        def ask():
            barrier.wait()
            found.append(R.reduction("prod", np.int64))
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(found) == 8 and all(r is found[0] for r in found)
        assert builds == ["aiofabric_prod_int64"]  # one try, with a compiler or without
        assert R.reduction("prod", "int64") is found[0] and len(builds) == len(set(builds))
    finally:
        monkeypatch.undo()
        R.clear_cache()
    assert R.reduction("sum", np.float32) is not first  # cleared: a new object (the library came from the disk)
    if HAVE_CC:
        assert R.reduction("sum", np.float32).kernel.build["cached"]


def test_each_kernel_is_its_generated_source():
    for op in R.OPS:
        for dtype in R.DTYPES:
            source = R.c_source(op, dtype)
            assert f"void {R.function_name(op, dtype)}(" in source and "restrict" not in source.split("*/", 1)[1]
            assert ("f2h(" in source) is (dtype.name == "float16")
            assert re.search(r"int64_t n\)", source)
