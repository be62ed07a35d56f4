"""nccl-tests for aiofabric's collectives: a size sweep timing each collective out of place and in place, checking
every element against numpy reduced in the ring's order, and printing nccl-tests' table (size, count, type, redop,
root; time, algbw, busbw, #wrong per placement) with its closing "Avg bus bandwidth" line.

As in nccl-tests, `size` is the larger of the send and receive buffers of one rank in bytes and `count` its elements
(a count that does not divide by the ranks is rounded down for reduce-scatter and allgather), algbw = size / time,
and busbw = algbw x the collective's factor (layout.BUS_FACTORS).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Sequence

import numpy as np

from . import layout
from .communicator import Communicator
from .launch import run_ranks
from ..sched.reduce import UFUNCS

PLACEMENTS = ("out-of-place", "in-place")


@dataclasses.dataclass
class PerfConfig:
    kind: str  # one of layout.KINDS but barrier
    sizes: list[int]
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    check: bool = True
    progress: bool = False


def ring_reference(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """What a ring allreduce of `xs` (one array per rank) computes, in its order: chunk c starts at rank c + 1 and
    each later rank applies `mine OP arrived`, ending at rank c. Floating-point results are exact only in this order."""
    n, ufunc = len(xs), UFUNCS[op]
    out = np.empty_like(xs[0])
    for c, piece in enumerate(layout.chunks(xs[0].size, n)):
        part = slice(piece.start, piece.start + piece.length)
        acc = xs[(c + 1) % n][part].copy()
        with np.errstate(all="ignore"):  # overflow to inf, integer wrap: what the kernels do too
            for k in range(2, n + 1):
                acc = ufunc(xs[(c + k) % n][part], acc)
        out[part] = acc
    return out


def _inputs(rng: np.random.Generator, dtype: np.dtype[Any], count: int, ranks: int) -> list[np.ndarray]:
    if dtype.kind == "f":  # small integers in floating point: sums stay exact-ish and finite, like nccl-tests' data
        return [rng.integers(-8, 8, count).astype(dtype) for _ in range(ranks)]
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(ranks)]


class _Case:
    """One collective at one size: every rank's arrays for a placement (each process draws them all from one seed,
    so the expected result is known everywhere), the call on this process's ranks, and their expected results."""

    def __init__(self, comms: list[Communicator], config: PerfConfig, size: int, rng: np.random.Generator) -> None:
        self.comms, self.config, self.kind, self.rng = comms, config, config.kind, rng
        self.n, self.dtype = comms[0].size, np.dtype(config.dtype)
        n = self.n
        count = size // self.dtype.itemsize
        if self.kind in ("reduce_scatter", "allgather"):
            count -= count % n
        self.count, self.size = count, count * self.dtype.itemsize
        self.part = count // n if self.kind in ("reduce_scatter", "allgather") else count

    def fill(self, placement: str) -> None:
        """Fresh inputs. In place (nccl-tests' layout): allreduce and broadcast results replace x; allgather's x is
        the rank's part of out; reduce-scatter's out is the rank's part of x."""
        n, kind, dtype, part = self.n, self.kind, self.dtype, self.part
        inputs = _inputs(self.rng, dtype, self.count if kind != "allgather" else part, n)
        self.originals = [x.copy() for x in inputs]
        self.inplace = placement == "in-place"
        if not self.inplace:
            self.xs, self.outs = inputs, [np.zeros(part if kind == "reduce_scatter" else self.count, dtype)
                                          for _ in range(n)]
        elif kind == "allgather":
            self.outs = [np.zeros(self.count, dtype) for _ in range(n)]
            self.xs = [out[r * part:(r + 1) * part] for r, out in enumerate(self.outs)]
            for x, given in zip(self.xs, inputs):
                x[:] = given
        elif kind == "reduce_scatter":
            self.xs = inputs
            self.outs = [x[r * part:(r + 1) * part] for r, x in enumerate(inputs)]
        else:
            self.xs = self.outs = inputs

    def expected(self) -> list[np.ndarray]:
        n, xs = self.n, self.originals
        if self.kind == "allreduce":
            return [ring_reference(xs, self.config.op)] * n
        if self.kind == "reduce_scatter":
            whole = ring_reference(xs, self.config.op)
            return [whole[r * self.part:(r + 1) * self.part] for r in range(n)]
        if self.kind == "allgather":
            return [np.concatenate(xs)] * n
        return [xs[self.config.root]] * n

    async def run(self) -> None:
        await run_ranks([functools.partial(self._call, comm) for comm in self.comms])

    async def _call(self, comm: Communicator) -> np.ndarray:
        x, out, config = self.xs[comm.rank], self.outs[comm.rank], self.config
        if self.kind == "allreduce":
            return await comm.allreduce(x, out, op=config.op)
        if self.kind == "broadcast":
            return await comm.broadcast(x, out, root=config.root)
        if self.kind == "reduce_scatter":
            return await comm.reduce_scatter(x, out, op=config.op)
        return await comm.allgather(x, out)

    async def wrong(self) -> int:
        """Elements wrong at every rank of the job: each rank counts its own, and an allreduce sums them (over the
        job's ranks in other processes too, as nccl-tests does)."""
        expected = self.expected()
        counts = [np.array([np.count_nonzero(_differ(self.outs[c.rank], expected[c.rank]))], np.int64)
                  for c in self.comms]
        await run_ranks([functools.partial(c.allreduce, count) for c, count in zip(self.comms, counts)])
        return int(counts[0][0])


def _differ(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elements whose bits differ (NaN payloads and signed zeros count)."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    return got.view(width) != want.view(width)


async def run_perf(comms: list[Communicator], config: PerfConfig) -> dict[str, Any]:
    """The sweep: per size and placement, warm-up runs, `iters` timed runs (mean wall time of all ranks finishing),
    then, with `check`, one run on fresh inputs checked element by element."""
    n, rng = comms[0].size, np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for size in config.sizes:
        case = _Case(comms, config, size, rng)
        for placement in PLACEMENTS:
            case.fill(placement)
            for _ in range(config.warmup):
                await case.run()
            started = time.perf_counter()
            for _ in range(config.iters):
                await case.run()
            seconds = (time.perf_counter() - started) / max(config.iters, 1)
            wrong = 0
            if config.check:
                case.fill(placement)
                await case.run()
                wrong = await case.wrong()
            algbw = case.size / seconds / 1e9 if seconds > 0 else 0.0
            rows.append({"size": case.size, "count": case.count, "dtype": config.dtype, "op": _op(config),
                         "root": _root(config), "placement": placement, "time_us": round(seconds * 1e6, 2),
                         "algbw_GBps": round(algbw, 6), "busbw_GBps": round(layout.bus_bandwidth(config.kind, n,
                                                                                              algbw), 6),
                         "wrong": wrong if config.check else None})
        if config.progress:
            print(f"{config.kind}: {case.size} B done", file=sys.stderr)
    busbws = [row["busbw_GBps"] for row in rows]
    wrong_total = sum(row["wrong"] or 0 for row in rows)
    result: dict[str, Any] = {"collective": config.kind, "ranks": n, "local_ranks": [c.rank for c in comms],
                              "rows": rows,
                              "avg_busbw_GBps": round(sum(busbws) / len(busbws), 4) if busbws else 0.0,
                              "wrong": wrong_total, "checked": config.check}
    if wrong_total:
        result["error"] = f"{wrong_total} elements differ from the expected result (see the #wrong columns)"
    return result


def _op(config: PerfConfig) -> str:
    return config.op if config.kind in ("allreduce", "reduce_scatter") else "none"


def _root(config: PerfConfig) -> int:
    return config.root if config.kind == "broadcast" else -1


def format_table(result: dict[str, Any]) -> str:
    """nccl-tests' table: one line per size, the out-of-place columns then the in-place ones."""
    lines = [f"# aiofabric {result['collective']}: {result['ranks']} ranks",
             "#" + " " * 54 + f"{'out-of-place':>33}" + f"{'in-place':>33}",
             f"#{'size':>11} {'count':>12} {'type':>7} {'redop':>6} {'root':>6}"
             + f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" * 2,
             f"#{'(B)':>11} {'(elements)':>12} {'':>7} {'':>6} {'':>6}"
             + f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" * 2]
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        by_size.setdefault(row["size"], {})[row["placement"]] = row
    for size, placed in by_size.items():
        first = next(iter(placed.values()))
        line = (f" {size:>11} {first['count']:>12} {layout.NCCL_NAMES[first['dtype']]:>7} {first['op']:>6} "
                f"{first['root']:>6}")
        for placement in PLACEMENTS:
            row = placed[placement]
            wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
            line += f" {row['time_us']:>10.1f} {row['algbw_GBps']:>7.2f} {row['busbw_GBps']:>7.2f} {wrong:>6}"
        lines.append(line)
    lines.append(f"# Out of bounds values : {result['wrong']} {'OK' if not result['wrong'] else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {result['avg_busbw_GBps']:g}")
    return "\n".join(lines)
