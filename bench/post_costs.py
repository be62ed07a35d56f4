"""Where the driver's CPU per posted work request goes: warm loops on a bare QP, and the hot functions inside a run of
`aiofabric bench write`, for one or more trees of this repository (old against new: a `git worktree` of each).

    python bench/post_costs.py warm [--tree DIR ...] [--rounds 3]
    python bench/post_costs.py poll [--tree DIR ...] [--rounds 3]
    python bench/post_costs.py inside [--tree DIR ...] [--rounds 3] [-- BENCH ARGS]

warm: thread CPU per work request of `post_many` of 32 and of 32 `post_write`s in `batch()`, a completion retiring
them after each (tests/support/bare_qp.py: no emulator, doorbells recorded), in each send-queue mode. Best of
`--rounds` repeats; a loop with hot caches, the floor of what the code costs.

poll: thread CPU of one CQ poll that finds 1, 4, 16 or 48 requester CQEs (each completing a post_many of 8 on its
own QP), in a warm loop: the poll only, not the posts or the CQEs' writing.

inside: `bench write` (default: --size 64 --qps 64 --depth 32 --iters 2000 --post-list 32) with the hot functions
wrapped, each call's thread CPU added up: per call and per work request, beside the bench's own driver CPU per
operation. The wrappers cost ~0.3 us a call themselves; the figures are what the functions cost among everything
else the process does (cold caches), which is what the benchmark measures. Rounds alternate the trees.

Every measurement is a fresh process with PYTHONPATH set to the tree (the bare QP is this tree's tests/support).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("thor2", "thor", "psn-table")
BENCH = ["--size", "64", "--qps", "64", "--depth", "32", "--iters", "2000", "--post-list", "32"]
HOT = [  # (module, owner, function, label, coroutine)
    ("post", "QueuePair", "post_many", "post_many", True),
    ("post", "QueuePair", "post_write", "post_write", True),
    ("workqueue", "SendQueueCodec", "post_run", "  codec post_run", False),
    ("workqueue", "SendQueueCodec", "post_one", "  codec post_one", False),
    ("post", "QueuePair", "_ring_sq", "  SQ doorbell", False),
    ("cq", "CompletionQueue", "poll", "CQ poll", False),
    ("qp", "QueuePairLife", "send_completed", "  send_completed", False),
    ("poller", "Poller", "poll_all", "poller poll_all", False),
    ("poller", "Poller", "_spin", "poller spin", True),
    ("poller", "Poller", "_drain_nq", "poller NQ drain + arms", False),
]

WARM = r"""
import importlib.util, json, sys, time, timeit
spec = importlib.util.spec_from_file_location("bare_qp", sys.argv[1])  # this tree's; aiofabric the measured tree's
bare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bare)
bare_qp, complete, region, run = bare.bare_qp, bare.complete, bare.region, bare.run
result = {}
for mode in sys.argv[2].split(","):
    qp = bare_qp(mode, sq_depth=64)
    src, dst = region(qp, key=0x10), region(qp, key=0x20)
    offsets = range(0, 32 * 64, 64)
    def many():
        run(qp.post_many("write", src, dst, 64, offsets))
        complete(qp)
    def one_by_one():
        with qp.batch():
            for k in range(32):
                run(qp.post_write(src, dst, 64, local_offset=64 * k, remote_offset=64 * k, signaled=k == 31))
        complete(qp)
    for name, body in (("post_many", many), ("per_op", one_by_one)):
        best = min(timeit.repeat(body, number=2000, repeat=int(sys.argv[3]), timer=time.thread_time))
        result[f"{mode}/{name}"] = best / 2000 / 32 * 1e6
print(json.dumps(result))
"""

POLL = r"""
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("bare_qp", sys.argv[1])
bare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bare)
from aiofabric.autogen import bnxt
from aiofabric.hw.cqe import CQ_ENTRY, CQE_REQ
from aiofabric.verbs.cq import CompletionQueue
qps = [bare.bare_qp("thor2", sq_depth=64) for _ in range(48)]
cq = CompletionQueue(qps[0].device, bare.Poller(), 1024)
cq.id = 3
for qp in qps:
    qp.device, qp.send_cq, qp.recv_cq = qps[0].device, cq, cq
    cq.qps[qp.handle] = qp
src, dst = bare.region(qps[0], key=0x10), bare.region(qps[0], key=0x20)
produced, result = 0, {}
for per in (1, 4, 16, 48):
    best = None
    for _ in range(int(sys.argv[2])):
        spent = 0.0
        for _ in range(2000):
            for qp in qps[:per]:
                bare.run(qp.post_many("write", src, dst, 64, range(0, 8 * 64, 64)))
                sq = qp.send_queue
                offset = produced % cq.depth * CQ_ENTRY.size
                CQ_ENTRY.publish(cq.ring.view[offset:offset + CQ_ENTRY.size], CQE_REQ.pack(
                    qp.handle, sq.posted % sq.geometry.size, bnxt.CQ_BASE_CQE_TYPE_REQ, 0), produced, cq.depth)
                produced += 1
            started = time.thread_time()
            cq.poll()
            spent += time.thread_time() - started
        best = spent if best is None else min(best, spent)
    result[per] = best / 2000 * 1e6
print(json.dumps(result))
"""

INSIDE = r"""
import collections, contextlib, io, json, runpy, sys, time
from aiofabric.verbs import cq, poller, post, qp, workqueue
spent = collections.defaultdict(lambda: [0, 0.0])
def wrap(owner, name, label, coroutine):
    original = getattr(owner, name)
    if coroutine:
        async def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return await original(*args, **kwargs)
            finally:
                spent[label][0] += 1; spent[label][1] += time.thread_time() - started
    else:
        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label][0] += 1; spent[label][1] += time.thread_time() - started
    setattr(owner, name, timed)
modules = {"post": post, "workqueue": workqueue, "cq": cq, "qp": qp, "poller": poller}
for module, owner, name, label, coroutine in json.loads(sys.argv[1]):
    wrap(getattr(modules[module], owner), name, label, coroutine)
out = io.StringIO()
sys.argv = ["aiofabric", "bench", "write", *sys.argv[2:], "--json"]
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    runpy.run_module("aiofabric", run_name="__main__")
doc = json.loads(out.getvalue())
doc = doc[0] if isinstance(doc, list) else doc
print(json.dumps({"driver_cpu_us_per_op": doc.get("driver_cpu_us_per_op"), "ops": doc.get("ops"),
                  "verified": doc.get("verified"), "error": doc.get("error"), "spent": spent}))
"""


def child(tree: Path, code: str, *args: str) -> dict:
    """Run `code` with `tree` first on the path (from a scratch directory: `-c` puts the working directory first)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="aiofabric-post-costs-") as scratch:
        result = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                                timeout=600, cwd=scratch)
    if result.returncode:
        raise SystemExit(f"{tree}: exit {result.returncode}: {result.stderr.strip()[-800:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm(trees: list[Path], rounds: int) -> None:
    for tree in trees:
        figures = child(tree, WARM, str(ROOT / "tests" / "support" / "bare_qp.py"), ",".join(MODES), str(rounds))
        print(f"{tree}: thread CPU per work request, warm loop (best of {rounds})")
        for mode in MODES:
            print(f"  {mode:10s} post_many of 32 {figures[f'{mode}/post_many']:6.2f} us   "
                  f"post_write x32 in batch() {figures[f'{mode}/per_op']:6.2f} us")


def poll(trees: list[Path], rounds: int) -> None:
    for tree in trees:
        figures = child(tree, POLL, str(ROOT / "tests" / "support" / "bare_qp.py"), str(rounds))
        print(f"{tree}: thread CPU of a CQ poll, warm loop (best of {rounds})")
        for per, seconds in figures.items():
            print(f"  {per:>2} CQEs: {seconds:6.2f} us a poll, {seconds / int(per):5.2f} us a CQE")


def inside(trees: list[Path], rounds: int, bench: list[str]) -> None:
    runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
    for round_ in range(rounds):
        for tree in trees if round_ % 2 == 0 else trees[::-1]:
            runs[tree].append(child(tree, INSIDE, json.dumps(HOT), *bench))
    for tree, docs in runs.items():
        failures = "".join(f" ({doc['error']})" for doc in docs if doc["error"])
        print(f"{tree}: bench write {' '.join(bench)}; per round: driver CPU per op "
              f"{', '.join(str(round(doc['driver_cpu_us_per_op'] or 0, 2)) for doc in docs)} us{failures}")
        for _, _, _, label, _ in HOT:
            cells = [(d["spent"].get(label, [0, 0.0]), d["ops"] or 1) for d in docs]
            if not any(calls for (calls, _), _ in cells):
                continue
            per_call = sorted(seconds / calls * 1e6 for (calls, seconds), _ in cells if calls)
            per_op = sorted(seconds / ops * 1e6 for (calls, seconds), ops in cells if calls)
            print(f"  {label:26s} {per_call[len(per_call) // 2]:8.2f} us a call  {per_op[len(per_op) // 2]:6.3f} us "
                  f"per work request (medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("warm", "poll", "inside"))
    parser.add_argument("--tree", action="append", type=Path, help="a tree of this repository (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after it: bench write's arguments (inside)
    args = parser.parse_args(argv[:split])
    trees = [tree.resolve() for tree in args.tree or [ROOT]]
    if args.what == "warm":
        warm(trees, args.rounds)
    elif args.what == "poll":
        poll(trees, args.rounds)
    else:
        inside(trees, args.rounds, argv[split + 1:] or BENCH)


if __name__ == "__main__":
    main()
