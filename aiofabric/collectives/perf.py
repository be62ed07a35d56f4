"""nccl-tests for aiofabric's collectives, run as its common.cu runs them: per type, op and root (`-d all`, `-o all`,
`-r all` loop), a warm-up of every size (doubling from the smallest), then per size and placement (out of place, in
place) one untimed run, `iters` timed iterations of `agg` collectives each, and `check` runs on fresh inputs checked
element by element against numpy (reference.py: the ring's order, bit for bit). Sizes, counts and bandwidths are
nccl-tests' (layout.nccl_counts, alg_bandwidth, bus_bandwidth); the time is each rank's mean over its iterations
(the ranks of a process loop each on its own, as nccl-tests' threads do), then averaged over the ranks as `-a`
says. Each row is handed to `emit` as its text line as soon as it is measured.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import numpy as np

from . import layout, nccl_format, reference
from .communicator import GATHERING, REDUCING, ROOTED, SCATTERING, Communicator
from .launch import run_ranks
from .steps import floating

PLACEMENTS = ("out-of-place", "in-place")


@dataclasses.dataclass
class PerfConfig:
    kind: str  # one of the Communicator's PUBLIC_KINDS
    sizes: list[int]
    iters: int = 20
    warmup: int = 1
    dtypes: Sequence[str] = ("float32",)
    ops: Sequence[str] = ("sum",)
    roots: Sequence[int] = (0,)
    check: int = 1  # check runs per size and placement (0: none)
    agg: int = 1  # collectives per timed iteration (-m)
    cycles: int = 1  # sweeps (-N; 0: until cancelled)
    average: int = 1  # -a
    blocking: int = 0  # -z: 1 barrier after each collective, 3 after each iteration (not timed)
    warmup_sizes: Sequence[int] = ()  # nccl-tests warms every size from the smallest, doubling


def _inputs(rng: np.random.Generator, dtype: np.dtype[Any], count: int, ranks: int) -> list[np.ndarray]:
    if floating(dtype):  # small integers in floating point: sums stay exact-ish and finite, like nccl-tests' data
        return [rng.integers(-8, 8, count).astype(dtype) for _ in range(ranks)]
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(ranks)]


class _Case:
    """One collective at one size, type, op and root: every rank's arrays for a placement (each process draws them
    all from one seed, so the expected result is known everywhere), the call on this process's ranks, and the
    check."""

    def __init__(self, comms: list[Communicator], kind: str, size: int, dtype: str, op: str, root: int,
                 rng: np.random.Generator) -> None:
        self.comms, self.kind, self.rng, self.op, self.root = comms, kind, rng, op, root
        self.n, self.dtype = comms[0].size, np.dtype(dtype)
        self.send, self.receive, self.count = layout.nccl_counts(kind, size, self.dtype.itemsize, self.n)
        self.size = max(self.send, self.receive) * self.dtype.itemsize

    def fill(self, placement: str) -> None:
        """Fresh inputs, and outs of zeros; in place as nccl-tests lays it out: x is out (allreduce, broadcast,
        reduce, sendrecv), x is part `rank` of out (allgather, gather), out is part `rank` of x (reduce-scatter,
        scatter)."""
        n, kind, dtype, part = self.n, self.kind, self.dtype, self.count
        inputs = _inputs(self.rng, dtype, self.send, n)
        self.originals = [x.copy() for x in inputs]
        if placement == "out-of-place":
            self.xs, self.outs = inputs, [np.zeros(self.receive, dtype) for _ in range(n)]
        elif kind in GATHERING:
            self.outs = [np.zeros(self.receive, dtype) for _ in range(n)]
            self.xs = [out[r * part:(r + 1) * part] for r, out in enumerate(self.outs)]
            for x, given in zip(self.xs, inputs):
                x[:] = given
        elif kind in SCATTERING:
            self.xs = inputs
            self.outs = [x[r * part:(r + 1) * part] for r, x in enumerate(inputs)]
        else:
            self.xs = self.outs = inputs
        self.before = [out.copy() for out in self.outs]  # what a rank whose out is not written keeps

    async def run(self) -> None:
        await run_ranks([functools.partial(self.call, comm) for comm in self.comms])

    async def call(self, comm: Communicator) -> np.ndarray:
        options: dict[str, Any] = {"op": self.op} if self.kind in REDUCING else {}
        if self.kind in ROOTED:
            options["root"] = self.root
        return await getattr(comm, self.kind)(self.xs[comm.rank], self.outs[comm.rank], **options)

    async def wrong(self) -> int:
        """Elements wrong at every rank of the job: each rank counts its own, and an allreduce sums them (over the
        job's ranks in other processes too, as nccl-tests does)."""
        expected = reference.expected(self.kind, self.originals, self.op, self.root)
        wants = [self.before[r] if want is None else want for r, want in enumerate(expected)]
        counts = [np.array([np.count_nonzero(_differ(self.outs[c.rank], wants[c.rank]))], np.int64)
                  for c in self.comms]
        await run_ranks([functools.partial(c.allreduce, count) for c, count in zip(self.comms, counts)])
        return int(counts[0][0])


def _differ(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elements whose bits differ (NaN payloads and signed zeros count)."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    return np.asarray(got.view(width) != want.view(width))


async def _job_seconds(comms: list[Communicator], seconds: list[float], average: int) -> float:
    """The ranks' times (`seconds[i]`: comms[i]'s) made the job's, as nccl-tests' -a: rank 0's, or the mean, least
    or most of the ranks'."""
    values = [np.array([value], np.float64) for value in seconds]
    if average == 0:
        await run_ranks([functools.partial(c.broadcast, v, root=0) for c, v in zip(comms, values)])
    else:
        await run_ranks([functools.partial(c.allreduce, v, op={1: "sum", 2: "min", 3: "max"}[average])
                         for c, v in zip(comms, values)])
    return float(values[0][0]) / (comms[0].size if average == 1 else 1)


async def _timed(case: _Case, comm: Communicator, config: PerfConfig) -> float:
    """One rank's timed iterations, as each of nccl-tests' threads times its own: seconds per collective. The ranks
    of this process loop each on its own, so one that finished a run starts the next while the others finish theirs
    (the collectives' ready messages keep them in step), as separate processes would."""
    timed = 0.0
    for _ in range(config.iters):
        started = time.perf_counter()
        for _ in range(config.agg):
            await case.call(comm)
            if config.blocking == 1:
                await comm.barrier()
        timed += time.perf_counter() - started
        if config.blocking == 3:
            await comm.barrier()
    runs = config.iters * config.agg
    return timed / runs if runs else 0.0


async def _placement(case: _Case, placement: str, config: PerfConfig) -> tuple[float, int | None]:
    """One placement of one size: (seconds per collective, elements wrong or None when unchecked)."""
    comms = case.comms
    case.fill(placement)
    await case.run()  # nccl-tests' untimed first run ("Sync")
    per_rank = await run_ranks([functools.partial(_timed, case, comm, config) for comm in comms])
    seconds = await _job_seconds(comms, per_rank, config.average)
    wrong = None
    for _ in range(config.check):
        case.fill(placement)
        await case.run()
        wrong = await case.wrong()
        if wrong:
            break
    return seconds, wrong


async def run_perf(comms: list[Communicator], config: PerfConfig,
                   emit: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep, as nccl-tests' TimeTest per type, op and root; `emit` gets each row's text line. Ops loop for the
    reductions (and sendrecv, which prints them, as nccl-tests'), roots for the rooted collectives."""
    n, rng = comms[0].size, np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    failed = 0  # nccl-tests' "Out of bounds values": sizes x placements with a wrong element
    ops = config.ops if config.kind in REDUCING or config.kind == "sendrecv" else config.ops[:1]
    roots = config.roots if config.kind in ROOTED else config.roots[:1]
    for dtype in config.dtypes:
        for op in ops:
            for root in roots:
                for size in config.warmup_sizes:
                    case = _Case(comms, config.kind, size, dtype, op, root, rng)
                    case.fill("out-of-place")
                    for _ in range(config.warmup):
                        await case.run()
                cycle = 0
                while config.cycles == 0 or cycle < config.cycles:
                    cycle += 1
                    for size in config.sizes:
                        case = _Case(comms, config.kind, size, dtype, op, root, rng)
                        line = nccl_format.row_start(case.size, case.count, layout.NCCL_NAMES[dtype], _op(config, op),
                                                     _root(config, root))
                        for placement in PLACEMENTS:
                            seconds, wrong = await _placement(case, placement, config)
                            failed += bool(wrong)
                            algbw = layout.alg_bandwidth(config.kind, n, case.count, case.dtype.itemsize, seconds)
                            busbw = layout.bus_bandwidth(config.kind, n, algbw)
                            rows.append({"size": case.size, "count": case.count,
                                         "type": layout.NCCL_NAMES[dtype], "op": _op(config, op),
                                         "root": _root(config, root), "placement": placement,
                                         "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw,
                                         "wrong": wrong})
                            line += nccl_format.row_body(seconds * 1e6, algbw, busbw, wrong)
                        if emit is not None:
                            emit(line)
    busbws = [row["busbw_GBps"] for row in rows]
    wrong_total = sum(row["wrong"] or 0 for row in rows)
    result: dict[str, Any] = {"collective": config.kind, "ranks": n, "local_ranks": [c.rank for c in comms],
                              "rows": rows, "avg_busbw_GBps": sum(busbws) / len(busbws) if busbws else 0.0,
                              "wrong": wrong_total, "out_of_bounds": failed, "checked": config.check > 0}
    if wrong_total:
        result["error"] = (f"{wrong_total} elements differ from the expected result in {failed} test(s) (see the "
                           "#wrong columns)")
    return result


def _op(config: PerfConfig, op: str) -> str:
    return op if config.kind in REDUCING or config.kind == "sendrecv" else "none"


def _root(config: PerfConfig, root: int) -> int:
    return root if config.kind in ROOTED else -1
