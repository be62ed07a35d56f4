"""perftest's defaults, and its rules that derive one parameter from others (src/perftest_parameters.h, and in
src/perftest_parameters.c init_perftest_params, force_dependecies and ctx_set_max_inline), for bench and lat."""
from __future__ import annotations

import inspect

from .options import INLINE_TESTS
from ..verbs import QueuePair

DEF_SIZE_BW, DEF_SIZE_LAT = 65536, 2  # -s
DEF_ITERS, DEF_ITERS_WB = 1000, 5000  # -n: ib_write_bw runs DEF_ITERS_WB, every other test DEF_ITERS
DEF_TX_BW, DEF_TX_LAT = 128, 1  # -t: work requests in flight per QP (a latency test keeps one)
DEF_CQ_MOD = 100  # -Q: one signaled work request in this many
MSG_SIZE_CQ_MOD_LIMIT = 8192  # above this size perftest signals every work request, unless -Q, -a or -e says
NETXTREME_LAT_INLINE = 96  # ctx_set_max_inline: a latency test on a NETXTREME (BNXT) device inlines up to 96 bytes
PEAK_ITERS_LIMIT = 20000  # past this many iterations per QP perftest keeps no per-message times: no peak (0)
# the outstanding READ/atomic requests a QP takes without -o (perftest prints the device's in its header)
DEFAULT_OUTS = inspect.signature(QueuePair.connect).parameters["max_rd_atomic"].default


def default_iters(tool: str, test: str) -> int:
    """-n: 5000 for ib_write_bw, 1000 for every other test."""
    return DEF_ITERS_WB if tool == "bench" and test == "write" else DEF_ITERS


def default_inline(tool: str, test: str) -> int:
    """-I: 0 for a bandwidth test; a latency test on a NetXtreme device (every NIC aiofabric drives) inlines up to
    96 bytes of what it sends (write and send; a READ or atomic sends no data)."""
    return NETXTREME_LAT_INLINE if tool == "lat" and test in INLINE_TESTS else 0


def tx_depth(depth: int, iters: int, timed: bool) -> int:
    """The work requests in flight per QP: -t, but no more than -n unless the run is timed (-D, --run_infinitely)."""
    return depth if timed else min(depth, iters)


def cq_moderation(requested: int | None, size: int, depth: int, sweep: bool, events: bool) -> int:
    """-Q as perftest applies it: DEF_CQ_MOD unless given, 1 for messages above MSG_SIZE_CQ_MOD_LIMIT when -Q was
    not given (except in a sweep, -a, or with events, -e), and never more than the work requests in flight."""
    if requested is None:
        requested = 1 if size > MSG_SIZE_CQ_MOD_LIMIT and not sweep and not events else DEF_CQ_MOD
    return min(requested, depth)
