"""A run of several message sizes (bench's and lat's -a): the iterations each size gets when no -n says, the rows
run one after another on the same NICs, and the result that holds them."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Awaitable, Callable, TypeVar

from .options import PerftestOptions

# a timed sweep's probe of its first size: 16 iterations per QP, then 4x as many until one run takes PROBE_SECONDS
# (a short run is mostly filling the pipeline, and would make the size's estimate too slow)
SWEEP_PROBE, SWEEP_PROBE_MAX, PROBE_SECONDS = 16, 4096, 0.1
SWEEP_MIN_ITERS = 5  # perftest's least -n

Config = TypeVar("Config", bound=PerftestOptions)


async def run_sizes(config: Config, sizes: list[int], run_one: Callable[[Config], Awaitable[dict[str, Any]]]
                    ) -> list[dict[str, Any]]:
    """`run_one(config for one size)` for each of `sizes` (bench's or lat's config): its rows. With
    `config.sweep_seconds` (a sweep without -n or bench's -D), a probe of the first size (growing until it runs
    PROBE_SECONDS) and then iterations per size chosen to run about that long (`sweep_iterations`); on a TTY
    (`config.progress`) each size and its iterations on stderr."""
    timings: list[tuple[int, float]] = []  # (size, seconds per iteration) of the runs so far
    rows = []

    def per_iteration(sized: Config, row: dict[str, Any]) -> float:
        return row["seconds"] / (sized.iters + getattr(sized, "warmup", 0))  # lat's warm-up runs too

    for index, size in enumerate(sizes):
        sized = dataclasses.replace(config, size=size)
        if config.sweep_seconds is not None and not getattr(config, "duration", None):  # bench's -D times itself
            iters = SWEEP_PROBE
            while not timings:  # how long an iteration takes here
                probe = dataclasses.replace(sized, iters=iters)
                row = await run_one(probe)
                if row["seconds"] >= PROBE_SECONDS or iters >= SWEEP_PROBE_MAX:
                    timings.append((size, per_iteration(probe, row)))
                iters *= 4
            sized.iters = sweep_iterations(timings, size, config.sweep_seconds)
        if config.progress and len(sizes) > 1:
            print(f"\r  size {size} ({index + 1}/{len(sizes)}): {sized.iters} iterations   ", end="",
                  file=sys.stderr, flush=True)
        row = await run_one(sized)
        timings.append((size, per_iteration(sized, row)))
        rows.append(row)
    if config.progress and len(sizes) > 1:
        print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
    return rows


def sweep_iterations(timings: list[tuple[int, float]], size: int, seconds: float) -> int:
    """Iterations per QP for `size` to run about `seconds`, from earlier (size, seconds per iteration): a line
    through the last two sizes (a fixed cost plus a cost per byte), or, from one, a cost per byte alone (too
    few iterations rather than too many); at least SWEEP_MIN_ITERS."""
    (s1, t1) = timings[-1]
    per_byte, fixed = t1 / s1, 0.0
    if len(timings) > 1 and timings[-2][0] != s1:
        (s0, t0) = timings[-2]
        per_byte = max(0.0, (t1 - t0) / (s1 - s0))
        fixed = max(0.0, t1 - per_byte * s1)
    predicted = max(fixed + per_byte * size, 1e-9)
    return max(SWEEP_MIN_ITERS, int(seconds / predicted))


def sweep_result(config: PerftestOptions, rows: list[dict[str, Any]], mtu: int, requested: int,
                 **shared: Any) -> dict[str, Any]:
    """A run's result: its one row, or (`config.sizes`) the sweep's rows under what they share (`shared` besides the
    test, sizes, firmware and MTU), "verified" if every row is and the first failed row's "error". Each row says
    the MTU `requested` beside the one used."""
    rows = [{**row, "mtu_requested": requested} for row in rows]
    if config.sizes is None:
        return rows[0]
    failed = [row for row in rows if "error" in row]
    return {"verified": all(row["verified"] for row in rows), "test": config.test, "sizes": config.sizes,
            "rows": rows, "fw_version": rows[0]["fw_version"], "mtu": mtu, "mtu_requested": requested, **shared,
            **({"error": f"size {failed[0]['size']}: {failed[0]['error']}"} if failed else {})}
