"""Ring arithmetic, pure: how a buffer splits into ring chunks and pieces, which chunk each rank sends and receives at
each step, the immediates that name every message, and nccl-tests' bus bandwidth factors.

A ring of N ranks: rank r sends to r+1 and receives from r-1 (mod N). Allreduce is a reduce-scatter then an
allgather, each N-1 steps over N chunks; a chunk is cut into pieces of at most `piece` bytes, each its own message,
so the transfer of piece p+1 overlaps the reduction of piece p.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

# every kind a message's immediate can name (4 bits): the order is the wire's, so new kinds go at the end
KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "reduce", "gather", "scatter",
         "sendrecv", "alltoall")
# nccl-tests' busbw = algbw * factor (its doc/PERFORMANCE.md and each collective's *GetBw): what each rank's link
# carries, per byte of the result
BUS_FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "allgather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "barrier": lambda n: 0.0,
               "reduce": lambda n: 1.0, "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
               "sendrecv": lambda n: 1.0, "alltoall": lambda n: (n - 1) / n}
# nccl-tests' algbw = the bytes of `paramcount` elements x this, per second: the per-rank count's collectives count
# every rank's part (each collective's *GetBw)
ALG_FACTORS = {"allgather": lambda n: n, "reduce_scatter": lambda n: n, "gather": lambda n: n,
               "scatter": lambda n: n, "alltoall": lambda n: n}
PER_RANK = ("allgather", "reduce_scatter", "gather", "scatter", "alltoall")  # nccl-tests counts these per rank
# nccl-tests' type names (and numpy's) -> numpy's, and back for the table
DTYPE_NAMES = {"float": "float32", "half": "float16", "double": "float64", "int": "int32", "int32": "int32",
               "int64": "int64", "float32": "float32", "float16": "float16", "float64": "float64", "int8": "int8",
               "uint8": "uint8", "uint32": "uint32", "uint64": "uint64", "bfloat16": "bfloat16"}  # ml_dtypes'
NCCL_NAMES = {"float32": "float", "float16": "half", "float64": "double", "int32": "int32", "int64": "int64",
              "int8": "int8", "uint8": "uint8", "uint32": "uint32", "uint64": "uint64", "bfloat16": "bfloat16"}
PIECE_BYTES = 512 << 10  # a message: small enough to pipeline reductions with transfers, large enough to amortise
MAX_SEQ = 0xFFFF


class Piece(NamedTuple):
    """Elements [start, start + length) of the buffer: one message."""
    start: int
    length: int


def chunks(count: int, ranks: int) -> list[Piece]:
    """`count` elements as `ranks` contiguous chunks, the first `count % ranks` one element longer (so counts that
    do not divide work, and chunks may be empty)."""
    base, extra = divmod(count, ranks)
    out, start = [], 0
    for i in range(ranks):
        size = base + (i < extra)
        out.append(Piece(start, size))
        start += size
    return out


def pieces(chunk: Piece, itemsize: int, piece_bytes: int) -> list[Piece]:
    """A chunk cut into messages of at most `piece_bytes` (whole elements; an empty chunk has no piece)."""
    per = max(1, piece_bytes // itemsize)
    return [Piece(start, min(per, chunk.start + chunk.length - start))
            for start in range(chunk.start, chunk.start + chunk.length, per)]


def reduce_scatter_chunks(rank: int, ranks: int, step: int) -> tuple[int, int]:
    """(chunk sent, chunk received and reduced) at reduce-scatter `step`, arranged so rank r ends with chunk r
    fully reduced (what reduce_scatter returns at rank r)."""
    return (rank - step - 1) % ranks, (rank - step - 2) % ranks


def allgather_chunks(rank: int, ranks: int, step: int) -> tuple[int, int]:
    """(chunk sent, chunk received) at allgather `step`: rank r starts with chunk r complete."""
    return (rank - step) % ranks, (rank - step - 1) % ranks


def tag(kind: str, key: int, seq: int) -> int:
    """The immediate of message `seq` (1, 2, ...) of one collective on a link: bit 31 clear, the kind in bits 27-30,
    11 bits of the digest of what was asked in bits 16-26, the sequence number below."""
    if not 1 <= seq <= MAX_SEQ:
        raise ValueError(f"{kind}: {seq} messages on one link exceed the {MAX_SEQ} a run can name")
    return (KINDS.index(kind) << 27) | ((key & 0x7FF) << 16) | seq


def ready_tag(kind: str, key: int) -> int:
    """The immediate of a run's ready message: bit 31 set, the kind, and 27 bits of the digest. Every link's run
    starts with one, so ranks that disagree about what runs (another count, dtype, op or root) fail before any data
    moves, but for a 1 in 2^27 collision."""
    return 1 << 31 | KINDS.index(kind) << 27 | key & 0x7FFFFFF


def digest(*parts: object) -> int:
    """A stable 28-bit digest of `parts` (Python's hash() of a str differs from process to process)."""
    return zlib.crc32(repr(parts).encode()) & 0xFFFFFFF


def bus_bandwidth(kind: str, ranks: int, algbw: float) -> float:
    return algbw * BUS_FACTORS[kind](ranks)


def alltoall_landing(ranks: int, count: int) -> int:
    """Elements of landing memory an alltoall of `count` elements per peer takes along a ring of `ranks`: a part
    from every rank (at its origin's slot), and the parts passing through, never reused within a run: hop h brings
    ranks - h - 1 of them (h = 1 .. ranks - 2)."""
    return count * (ranks + (ranks - 1) * (ranks - 2) // 2)


def alg_bandwidth(kind: str, ranks: int, count: int, itemsize: int, seconds: float) -> float:
    """nccl-tests' algbw in GB/s of `count` elements (its paramcount) moved in `seconds` (0 for no time)."""
    return count * itemsize * ALG_FACTORS.get(kind, lambda n: 1)(ranks) / 1e9 / seconds if seconds > 0 else 0.0


def nccl_counts(kind: str, size: int, itemsize: int, ranks: int) -> tuple[int, int, int]:
    """(send, receive, per-call) element counts of a rank for nccl-tests' `size` bytes, as its *GetCollByteCount
    has them: the per-rank collectives (allgather, reduce-scatter, gather, scatter, alltoall) take size / ranks
    rounded down to whole 16-byte units; the per-call count is what nccl-tests prints as `count`."""
    count = size // itemsize
    if kind not in PER_RANK:
        return count, count, count
    base = (count // ranks) & ~(16 // itemsize - 1)
    if kind == "alltoall":
        return base * ranks, base * ranks, base
    return (base, base * ranks, base) if kind in ("allgather", "gather") else (base * ranks, base, base)
