"""A rank of a ring: its QPs to the next and previous rank, its registered buffers and receive pools, and the
collectives as scheduler batches, compiled once per (collective, count, dtype, op, root, placement) and replayed.

Every run of a collective on a link starts with a ready message from the receiver (a zero-byte WRITE_WITH_IMM): "my
buffers are yours to write". The sender's first write waits for it, so a rank that runs ahead never overwrites memory
its neighbour still reads, and never gets more than one run's messages ahead of its neighbour's receive pool (which
holds more than a run's messages): no RNR NAK, whatever the ranks' speeds. Every message's immediate names the
collective, a digest of its arguments and its sequence number on the link (`layout.tag`), and the receiver checks
it. Within a run no landing memory is reused: reduce-scatter lands step s in its own slot of the landing MR, and
allgather and broadcast write the final bytes in place. The ring's collectives are built here; reduce, gather,
scatter and sendrecv in their own modules, of the same steps (steps.py).
"""
from __future__ import annotations

from typing import Any, Callable

import anyio
import numpy as np

from . import layout
from .layout import PIECE_BYTES
from .. import sched
from .alltoall import alltoall_calls
from .gather import gather_calls
from .oneshot import ONESHOT_BYTES, fits, oneshot_calls
from .reduce import reduce_calls
from .scatter import scatter_calls
from .sendrecv import sendrecv_calls
from .steps import Link, Steps
from ..errors import CallError, FabricError
from ..sched.reduce import DTYPES, OPS as SCHED_OPS
from ..verbs import NIC, MemoryRegion

PUBLIC_KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter", "sendrecv",
                "alltoall")
OPS = (*SCHED_OPS, "avg")  # avg: the sum, divided once by the number of ranks where it is whole (steps.divide)
REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
GATHERING = ("allgather", "gather")  # x is count elements, out size x count: in place, x is out's part `rank`
SCATTERING = ("reduce_scatter", "scatter")  # x is size x count elements, out count: in place, out is x's part
BUILDERS: dict[str, Callable[..., list[sched.Call]]] = {  # the collectives built in their own modules
    "reduce": reduce_calls, "gather": gather_calls, "scatter": scatter_calls, "sendrecv": sendrecv_calls,
    "alltoall": alltoall_calls}
MAX_BATCHES = 32  # compiled collectives kept per communicator (least recently used dropped)
RUN_TIMEOUT = 60.0  # seconds a collective may take before it fails naming the calls still pending


class CollectiveError(FabricError):
    """A collective failed at a rank (its own failure, or a peer's); the communicator is unusable afterwards."""


class Communicator:
    """Rank `rank` of `size`. Made by a launcher (`collectives.local`), which connects the QPs and exchanges the
    buffers' keys. Collectives take numpy arrays (any shape, C-contiguous); `out=None` means in place."""

    def __init__(self, rank: int, size: int, work: MemoryRegion | None, landing: MemoryRegion | None,
                 next_link: Link | None, prev_link: Link | None, *, nic: NIC | None = None,
                 piece_bytes: int = PIECE_BYTES, timeout: float = RUN_TIMEOUT) -> None:
        self.rank, self.size, self.nic = rank, size, nic
        self.work, self.landing = work, landing
        self.next, self.prev = next_link, prev_link
        self.piece_bytes, self.timeout = piece_bytes, timeout
        self.capacity = work.length if work is not None else 0
        self.landing_capacity = landing.length if landing is not None else 0
        self.compute = sched.ComputeQueue(f"rank {rank} reduce")
        self.copies = sched.CopyQueue(f"rank {rank} copy")
        self._batches: dict[tuple[Any, ...], tuple[sched.Batch, Callable[..., dict[str, np.ndarray]]]] = {}
        self.broken: BaseException | None = None
        self.peer_failure: str | None = None  # news of another rank's end (the rendezvous's watch)
        self._running: anyio.CancelScope | None = None
        self._barrier = np.zeros(1, np.int32)
        self.oneshot_bytes = ONESHOT_BYTES  # allreduces up to this many bytes go one-shot (oneshot.py; 0: never)

    def __repr__(self) -> str:
        return f"Communicator(rank {self.rank} of {self.size})"

    def peer_failed(self, reason: str) -> None:
        """Another rank of the job is gone (`reason` names it): the collective under way fails now, naming it,
        instead of waiting for its timeout; later ones are refused."""
        self.peer_failure = reason
        if self._running is not None:
            self._running.cancel()

    # -- the collectives --------------------------------------------------------------------------------------------
    async def allreduce(self, x: np.ndarray, out: np.ndarray | None = None, *, op: str = "sum") -> np.ndarray:
        """out = x reduced over the ranks, elementwise (every rank gets the same bytes)."""
        return await self._collective("allreduce", x, out, op=op)

    async def reduce_scatter(self, x: np.ndarray, out: np.ndarray, *, op: str = "sum") -> np.ndarray:
        """out (count elements) = chunk `rank` of x (size * count elements) reduced over the ranks. In place: out is
        that chunk of x (`x[rank * count:(rank + 1) * count]`)."""
        return await self._collective("reduce_scatter", x, out, op=op)

    async def allgather(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (size * count elements) = every rank's x (count elements), in rank order. In place: x is this rank's
        part of out (`out[rank * count:(rank + 1) * count]`)."""
        return await self._collective("allgather", x, out)

    async def broadcast(self, x: np.ndarray, out: np.ndarray | None = None, *, root: int = 0) -> np.ndarray:
        """out = the root's x at every rank."""
        return await self._collective("broadcast", x, out, root=root)

    async def reduce(self, x: np.ndarray, out: np.ndarray | None = None, *, op: str = "sum",
                     root: int = 0) -> np.ndarray:
        """out at the root = x reduced over the ranks, elementwise (the other ranks' out is left as it was)."""
        return await self._collective("reduce", x, out, op=op, root=root)

    async def gather(self, x: np.ndarray, out: np.ndarray, *, root: int = 0) -> np.ndarray:
        """out at the root (size * count elements) = every rank's x (count elements), in rank order; the other
        ranks' out is left as it was. In place: x is this rank's part of out (`out[rank * count:(rank + 1) *
        count]`)."""
        return await self._collective("gather", x, out, root=root)

    async def scatter(self, x: np.ndarray, out: np.ndarray, *, root: int = 0) -> np.ndarray:
        """out (count elements) = chunk `rank` of the root's x (size * count elements; read at the root only). In
        place: out is that chunk of x (`x[rank * count:(rank + 1) * count]`)."""
        return await self._collective("scatter", x, out, root=root)

    async def sendrecv(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """out = the previous rank's x (rank - 1, mod size): every rank sends to the next at once, as nccl-tests'
        sendrecv_perf does."""
        return await self._collective("sendrecv", x, out)

    async def alltoall(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x and out of size * count elements: part d of x (`x[d * count:(d + 1) * count]`) goes to rank d, as
        part `rank` of its out. Along the ring a part for the rank h hops on is passed on h times, so the landing
        MR must hold layout.alltoall_landing(size, count) elements (launch's landing_bytes)."""
        return await self._collective("alltoall", x, out)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier: an allreduce of one element, which no rank can finish
        before every rank has contributed."""
        self._barrier[0] = 0
        await self._collective("allreduce", self._barrier, None, op="sum")

    # -- compiling and running ----------------------------------------------------------------------------------
    async def _collective(self, kind: str, x: np.ndarray, out: np.ndarray | None, *, op: str = "sum",
                          root: int = 0) -> np.ndarray:
        count, inplace, result, op_ = self._arguments(kind, x, out, op, root)
        if count == 0 or self.size == 1:
            if out is not None and x.size:
                np.copyto(out.reshape(-1), x.reshape(-1))
            return result
        key = (kind, count, x.dtype.str, op_, root, inplace, self._oneshot(kind, count, x.dtype.itemsize))
        entry = self._batches.pop(key, None)
        if entry is None:
            entry = self._compile(kind, count, x.dtype, op_, root, inplace)
        self._batches[key] = entry  # most recently used last
        while len(self._batches) > MAX_BATCHES:
            del self._batches[next(iter(self._batches))]
        batch, bindings = entry
        try:
            with anyio.CancelScope() as self._running:
                await batch.run(bindings(x.reshape(-1), result.reshape(-1)), timeout=self.timeout)
            if self._running.cancelled_caught:
                raise CollectiveError(f"rank {self.rank} failed: {kind} of {count} x {x.dtype}: {self.peer_failure}")
        except CollectiveError as error:
            self.broken = error
            raise
        except Exception as error:
            self.broken = error
            raise CollectiveError(f"rank {self.rank} failed: {kind} of {count} x {x.dtype}{self._blame(error)}: "
                                  f"{error}") from error
        except BaseException as error:  # cancelled mid-run: what the links hold is unknown
            self.broken = error
            raise
        finally:
            self._running = None
        return result

    def calls(self, kind: str, x: np.ndarray, out: np.ndarray | None = None, *, op: str = "sum",
              root: int = 0) -> list[sched.Call]:
        """The calls of collective `kind` (one of PUBLIC_KINDS: "allreduce", "reduce_scatter", ...) on `x` and `out`
        (arguments as the methods take them), to put in a batch of your own: `sched.compile([*step, *comm.calls(
        "allreduce", grads), *update])` plans the reduction between the kernels that write and read `grads`, and
        overlaps it with whatever else the batch does. Every rank's batch must hold the same collectives in the
        same order. Its runs take turns with this communicator's other collectives on the same copy queue, QPs and
        buffers; give the batch a timeout (`run(timeout=)`): a peer that never runs its part is otherwise waited
        for."""
        count, _, result, op_ = self._arguments(kind, x, out, op, root)
        if count == 0 or self.size == 1:
            raise ValueError(f"{kind}: {count} elements on {self.size} rank(s) move nothing: leave it out of the batch")
        return self._calls(kind, x.reshape(-1), result.reshape(-1), count, op_, root)

    def _arguments(self, kind: str, x: np.ndarray, out: np.ndarray | None, op: str,
                   root: int) -> tuple[int, bool, np.ndarray, str | None]:
        """Refuse, naming it, what collective `kind` cannot do with these arguments, before anything runs (so a
        refusal leaves the communicator usable); (count, in place?, the array the result lands in, the op or None)."""
        if kind not in PUBLIC_KINDS:
            raise ValueError(f"unknown collective {kind!r}; one of {', '.join(PUBLIC_KINDS)}")
        if self.peer_failure is not None:
            raise CollectiveError(f"rank {self.rank}: {self.peer_failure}")
        if self.broken is not None:
            raise CollectiveError(f"rank {self.rank}: the communicator failed earlier ({self.broken}); make a new "
                                  "one") from self.broken
        if out is None and kind in GATHERING + SCATTERING:
            raise ValueError(f"{kind}: needs out (its size differs from x's)")
        result = x if out is None else out
        _check_array(kind, "x", x)
        _check_array(kind, "out", result)
        if result.dtype != x.dtype:
            raise TypeError(f"{kind}: out is {result.dtype}, x is {x.dtype}")
        expected = x.size // self.size if kind in SCATTERING else x.size * self.size if kind in GATHERING else x.size
        if result.size != expected or kind in SCATTERING + ("alltoall",) and x.size % self.size:
            raise ValueError(f"{kind}: x has {x.size} elements and out {result.size}; "
                             + (f"x needs size ({self.size}) x out's" if kind in SCATTERING else
                                f"both need size ({self.size}) x the elements per rank" if kind == "alltoall" else
                                f"out needs size ({self.size}) x x's" if kind in GATHERING else
                                "they must be equal"))
        reduces = kind in REDUCING
        if reduces and op not in OPS:
            raise ValueError(f"{kind}: unknown op {op!r}; the ops are {', '.join(OPS)}")
        if reduces and x.dtype not in DTYPES:
            raise TypeError(f"{kind}: reductions take {', '.join(d.name for d in DTYPES)}, not {x.dtype}")
        if kind in ROOTED and (not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size):
            raise ValueError(f"{kind}: root must be a rank in [0, {self.size - 1}], not {root!r}")
        inplace = out is None or out is x
        if out is not None and not inplace and np.may_share_memory(x, out):
            if kind in GATHERING and _is_part(x, out, self.rank):
                inplace = True
            elif kind in SCATTERING and _is_part(out, x, self.rank):
                inplace = True
            else:
                raise ValueError(f"{kind}: out overlaps x; in place is " + (
                    "x = out[rank * count:(rank + 1) * count]" if kind in GATHERING else
                    "out = x[rank * count:(rank + 1) * count]" if kind in SCATTERING else "out=None"))
        buffer_bytes = max(x.nbytes, result.nbytes)
        if buffer_bytes > self.capacity:
            raise ValueError(f"{kind}: {buffer_bytes} bytes exceed the communicator's {self.capacity}-byte buffers "
                             "(its buffer_bytes)")
        count = result.size if kind in SCATTERING else x.size // self.size if kind == "alltoall" else x.size
        landing = layout.alltoall_landing(self.size, count) * x.itemsize
        if kind == "alltoall" and self.size > 1 and landing > self.landing_capacity:
            raise ValueError(f"alltoall: {count} elements per rank along a ring of {self.size} take {landing} bytes "
                             f"of landing memory; the communicator's has {self.landing_capacity} (its landing_bytes)")
        return count, inplace, result, op if reduces else None

    def _blame(self, error: BaseException) -> str:
        """The neighbour a failure points at: the rank behind the link whose QP failed, or, for a run that timed
        out, the rank whose link held the first call still pending."""
        timed_out = not isinstance(error, CallError)
        queues = [error.queue] if isinstance(error, CallError) else getattr(error, "pending_queues", [])
        for queue in queues:
            for link in (self.prev, self.next):
                if link is not None and queue.removesuffix(" recv") == sched.qp_name(link.qp):
                    return f" ({'waiting for' if timed_out else 'its link with'} rank {link.peer_rank})"
        return ""

    def _compile(self, kind: str, count: int, dtype: np.dtype[Any], op: str | None, root: int,
                 inplace: bool) -> tuple[sched.Batch, Callable[..., dict[str, np.ndarray]]]:
        total = count * self.size if kind in GATHERING + SCATTERING + ("alltoall",) else count
        # compile-time stand-ins, rebound every run; in place, one is a view of the other (views follow their input)
        mine = layout.chunks(total, self.size)[self.rank]
        x = np.zeros(total if kind in SCATTERING + ("alltoall",) else count, dtype)
        if not inplace:
            out = np.zeros(total if kind in GATHERING + ("alltoall",) else count, dtype)
        elif kind in GATHERING:
            out = np.zeros(total, dtype)
            x = out[mine.start:mine.start + mine.length]
        elif kind in SCATTERING:
            out = x[mine.start:mine.start + mine.length]
        else:
            out = x
        calls = self._calls(kind, x, out, count, op, root)
        names: tuple[str, ...]
        if inplace:  # one input, the other a view of it
            names = ("out",) if kind in GATHERING else ("x",)
        else:  # the inputs this rank's calls touch: x is read at the root only (broadcast, scatter), out written
            # there only (reduce, gather)
            names = tuple(name for name, used in (("x", kind not in ("broadcast", "scatter") or self.rank == root),
                                                  ("out", kind not in ("reduce", "gather") or self.rank == root))
                          if used)
        batch = sched.compile(calls, inputs={name: {"x": x, "out": out}[name] for name in names})

        def bindings(new_x: np.ndarray, new_out: np.ndarray) -> dict[str, np.ndarray]:
            given = {"x": new_x, "out": new_out}
            return {name: given[name] for name in names}
        return batch, bindings

    def _calls(self, kind: str, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
               root: int) -> list[sched.Call]:
        """This rank's calls: x and out are flat (in place, out is x or a view of it)."""
        builder = oneshot_calls if self._oneshot(kind, count, x.dtype.itemsize) else BUILDERS.get(kind)
        if builder is not None:
            return builder(self, x, out, count, op, root)
        return self._ring_calls(kind, x, out, count, op, root)

    def _oneshot(self, kind: str, count: int, itemsize: int) -> bool:
        return kind == "allreduce" and fits(self, count, itemsize, self.landing_capacity, self.oneshot_bytes)

    def _ring_calls(self, kind: str, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                    root: int) -> list[sched.Call]:
        """Allreduce, reduce-scatter, allgather and broadcast: every rank both sends to the next and receives from
        the previous (but a broadcast's root receives nothing, and the rank before it sends nothing)."""
        size, rank, next_link = self.size, self.rank, self.next
        assert next_link is not None
        total = count * size if kind in ("reduce_scatter", "allgather") else count
        run = Steps(self, kind, count, x.dtype, op, root, sends=kind != "broadcast" or (rank + 1) % size != root,
                    receives=kind != "broadcast" or rank != root)
        w, lands, isz = run.w[:total], run.lands, run.isz
        mine = layout.chunks(total, size)[rank]
        chunk_list = layout.chunks(total, size)
        largest = max(c.length for c in chunk_list)
        # whole elements per message, and at most MAX_PIECES per chunk (2 (size - 1) MAX_PIECES per broadcast), so a
        # run's messages on a link fit its receive pool
        piece = run.piece(largest, 2 * (size - 1)) if kind != "broadcast" else run.piece(total, 1)

        # 1. this run's input into the registered buffer; 2. our turn, the ready messages
        if kind == "allgather":
            run.copy_in(w[mine.start:mine.start + mine.length], x)
        elif kind != "broadcast" or rank == root:
            run.copy_in(w, x)
        run.start()
        # 3. reduce-scatter: step s lands in landing slot s and is reduced into the work buffer
        if kind in ("allreduce", "reduce_scatter"):
            slot = largest * isz
            for step in range(size - 1):
                sent, got = layout.reduce_scatter_chunks(rank, size, step)
                for at in layout.pieces(chunk_list[sent], isz, piece * isz):
                    run.write(next_link.landing, at, step * slot + (at.start - chunk_list[sent].start) * isz,
                              f"rs {step} chunk {sent}")
                for at in layout.pieces(chunk_list[got], isz, piece * isz):
                    low = step * slot // isz + at.start - chunk_list[got].start
                    landed = lands[low:low + at.length]
                    run.wait(landed, f"rs {step} landed {got}")
                    run.reduce(w[at.start:at.start + at.length], landed, f"rs {step} reduce {got}")
            run.average(w[mine.start:mine.start + mine.length])  # chunk `rank` is whole here
        # 4. allgather: every chunk in place at every rank
        if kind in ("allreduce", "allgather"):
            for step in range(size - 1):
                sent, got = layout.allgather_chunks(rank, size, step)
                for at in layout.pieces(chunk_list[sent], isz, piece * isz):
                    run.write(next_link.work, at, at.start * isz, f"ag {step} chunk {sent}")
                for at in layout.pieces(chunk_list[got], isz, piece * isz):
                    run.wait(w[at.start:at.start + at.length], f"ag {step} landed {got}")
        # 5. broadcast: a pipeline from the root along the ring
        if kind == "broadcast":
            for at in layout.pieces(layout.Piece(0, total), isz, piece * isz):
                if run.receives:
                    run.wait(w[at.start:at.start + at.length], f"bcast landed {at.start}")
                if run.wait_ready is not None:
                    run.write(next_link.work, at, at.start * isz, f"bcast {at.start}")
        # 6. the result out of the registered buffer
        run.copy_out(out, w[mine.start:mine.start + mine.length] if kind == "reduce_scatter" else w)
        return run.calls


def _is_part(part: np.ndarray, whole: np.ndarray, rank: int) -> bool:
    """Whether `part` is exactly chunk `rank` of `whole` (same dtype, contiguous, size divides)."""
    if part.dtype != whole.dtype or not part.size or whole.size % part.size:
        return False
    start = whole.__array_interface__["data"][0] + rank * part.nbytes
    return part.__array_interface__["data"][0] == start and whole.size // part.size > rank


def _check_array(kind: str, label: str, array: Any) -> None:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{kind}: {label} is a {type(array).__name__}, not a numpy array")
    if not array.flags.c_contiguous:
        raise ValueError(f"{kind}: {label} is not C-contiguous; pass np.ascontiguousarray(...)")
    if label == "out" and not array.flags.writeable:
        raise ValueError(f"{kind}: {label} is read-only")
