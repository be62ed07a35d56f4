"""Hot-path benchmark: the driver's CPU per RDMA operation and its latency, old code against new, same-run ratios.

    python bench/hotpath.py [--old 81f8b3a] [--new COMMIT] [--rounds 3] [--quick] [--json] [--skip-datapath]

The old code is a commit of this repository, checked out in a throwaway `git worktree` (removed at exit); the new
code is the tree this script sits in (or `--new COMMIT`, another worktree). Every measurement is a fresh
`python -m aiofabric ...` subprocess with PYTHONPATH set to one tree and a temp dir as cwd. The machine is noisy
(2 cores), so the rounds alternate old and new (round 1 old first, round 2 new first, ...) and every figure gives
each round's values, their medians, the ratio of the medians and the median of the per-round ratios:

1. per-op API: driver CPU per 64 B RDMA WRITE, 64 QPs x depth 32 (`bench write --json`), new/old; target <= 0.5;
2. batch API: the same with `--post-list 32` (32 work requests per call, one doorbell), new code only, against
   the old per-op figure of the same round; target <= 0.15 (reported unavailable if the flag is not accepted);
   1 and 2 again on Thor's send queue (`--profile thor-bs-v2`: static 128-byte WQEs, the PSN search table), the
   same targets;
3. QP scaling, new code only: CPU per write at 1024 QPs against 16 QPs, per-op and batched; target <= 1.2;
4. latency: `lat write --json` typical one-way latency (t_typical_us, lat's default 2 B), new/old; target <= 0.8.
   Since 4df83f5 lat's two NICs share one emulator process; the new code with one each (--no-shared-emulator) is
   shown too, and beside them the floor, a raw Python UDP ping-pong of 64 B datagrams between two processes on
   loopback (median half round trip);
5. emulator speed, no worse: `bench/datapath.py --quick --json` of each tree, its message-rate ratios (against the
   raw sendto() rate measured in the same run), new/old; target >= 0.9 (no worse, within the noise).

Progress goes to stderr, the table (or with --json one JSON object with every number) to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from udp_floor import FloorError, udp_pingpong

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300.0
NO_WORSE = 0.9  # the datapath ratios may lose this much to noise and still count as "no worse"
DATAPATH_FIELDS = ("ratio_write64_vs_raw_sendto", "ratio_bw_vs_raw_4KiB_datagrams", "ratio_many_vs_one")
FLOOR_ADDRESSES = ("127.0.0.240", "127.0.0.241")
STATIC = ("--profile", "thor-bs-v2")  # Thor's send queue: static 128-byte WQEs, the PSN search table


class RunError(Exception):
    """A measurement failed: the message says why (exit code, stderr tail, or what the JSON said)."""


class Unavailable(RunError):
    """The tree does not offer what the measurement needs (e.g. a flag it does not accept yet)."""


@dataclass(frozen=True)
class Tree:
    side: str  # "old" or "new"
    root: Path
    label: str  # the commit, or "working tree"


@dataclass(frozen=True)
class Plan:
    """Iterations of each measurement (bench iterations are per QP)."""
    rounds: int
    perop_iters: int
    lat_iters: int
    floor_trips: int
    iters_16: int
    iters_1024: int
    datapath: bool


@dataclass
class Series:
    """One quantity, a value per round (None where the run failed)."""
    values: list[float | None]
    errors: list[str] = field(default_factory=list)
    unavailable: str | None = None


@dataclass(frozen=True)
class Figure:
    """A line of the report: `test` against `base`, the ratio test/base and its target."""
    title: str
    unit: str
    base: str  # series keys
    test: str
    base_label: str  # how the table names them
    test_label: str
    target: tuple[str, float] | None  # ("<=", 0.7) or (">=", 0.9); None: informative


# -- subprocesses ------------------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tail(text: str, lines: int = 6, chars: int = 800) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-chars:] or "(no output)"


def tree_env(tree: Tree) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p)
    return env


def run(argv: Sequence[str], tree: Tree, cwd: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run argv in its own process group (the emulators it starts die with it on a timeout)."""
    proc = subprocess.Popen(list(argv), cwd=cwd, env=tree_env(tree), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            _, err = proc.communicate(timeout=10)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RunError(f"timed out after {timeout:.0f} s: {tail(err or '')}") from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def parse_json(stdout: str) -> Any:
    """The JSON a command printed: all of stdout, or else its last line that parses."""
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(stdout)
    for line in reversed(stdout.strip().splitlines()):
        if line.lstrip().startswith(("{", "[")):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise RunError(f"no JSON on stdout: {tail(stdout)}")


def run_json(argv: Sequence[str], tree: Tree, cwd: Path) -> dict[str, Any]:
    result = run(argv, tree, cwd)
    output = result.stdout + result.stderr
    if result.returncode == 2 and "unrecognized arguments" in output:
        raise Unavailable(f"the {tree.side} tree does not accept it: {tail(output, 2)}")
    if result.returncode != 0:
        raise RunError(f"exit {result.returncode}: {tail(result.stderr or result.stdout)}")
    doc = parse_json(result.stdout)
    if isinstance(doc, list):  # a row per size: the 64 B one, or else the last
        doc = next((row for row in doc if isinstance(row, dict) and row.get("size") == 64), doc[-1] if doc else {})
    if not isinstance(doc, dict):
        raise RunError(f"unexpected JSON: {tail(result.stdout)}")
    if doc.get("ok") is False:
        raise RunError(f"not ok: {doc.get('error')}")
    return doc


def number(doc: dict[str, Any], *keys: str) -> float:
    for key in keys:
        if isinstance(doc.get(key), (int, float)):
            return float(doc[key])
    raise RunError(f"none of {', '.join(keys)} in the JSON (keys: {', '.join(sorted(doc))})")


def aiofabric(tree: Tree, cwd: Path, *args: str) -> dict[str, Any]:
    return run_json([sys.executable, "-m", "aiofabric", *args, "--json"], tree, cwd)


def check_import(tree: Tree, cwd: Path) -> None:
    """Fail unless `import aiofabric` in this tree's environment loads this tree's package."""
    result = run([sys.executable, "-c", "import aiofabric; print(aiofabric.__file__)"], tree, cwd, timeout=60)
    if result.returncode != 0:
        raise RunError(f"the {tree.side} tree does not import: {tail(result.stderr)}")
    loaded = Path(result.stdout.strip()).resolve()
    if not loaded.is_relative_to(tree.root.resolve()):
        raise RunError(f"the {tree.side} side imports {loaded}, not from {tree.root}")
    log(f"{tree.side}: {tree.label}, imports {loaded}")


# -- measurements -------------------------------------------------------------------------------------------------

def bench_cpu(tree: Tree, cwd: Path, qps: int, iters: int, post_list: int | None = None, *flags: str) -> float:
    """Driver CPU µs per 64 B WRITE at `qps` QPs x depth 32, the bytes of every operation verified."""
    args = ["bench", "write", "--size", "64", "--qps", str(qps), "--depth", "32", "--iters", str(iters), *flags]
    # a completion every half depth (bench's default before it took perftest's CQ moderation), or each post list's
    args += ["--cq-mod", "16"] if post_list is None else ["--post-list", str(post_list)]
    doc = aiofabric(tree, cwd, *args)
    if doc.get("verified") is not True:
        raise RunError(f"not verified: {doc.get('verification', doc.get('error'))}")
    return number(doc, "driver_cpu_us_per_op")


def latency(tree: Tree, cwd: Path, iters: int, *flags: str) -> float:
    """Typical one-way latency (µs) of WRITEs of lat's default size, a ping-pong between two emulated NICs."""
    doc = aiofabric(tree, cwd, "lat", "write", "--iters", str(iters), *flags)
    if doc.get("verified") is False:
        raise RunError(f"not verified: {doc.get('verification')}")
    return number(doc, "t_typical_us", "t_typical", "t_median_us")


def datapath_keys(tree: Tree) -> list[str]:
    return [f"dp:{name}/{tree.side}" for name in DATAPATH_FIELDS]


def datapath(tree: Tree, cwd: Path) -> dict[str, float]:
    """bench/datapath.py --quick of the tree: its message-rate ratios (to the raw sendto() rate of the same run,
    and 64 QPs x depth 32 against 1 QP x depth 1), by series key."""
    doc = run_json([sys.executable, str(tree.root / "bench" / "datapath.py"), "--quick", "--json"], tree, cwd)
    return {key: number(doc, name) for key, name in zip(datapath_keys(tree), DATAPATH_FIELDS)}


def udp_floor(trips: int) -> float:
    """Median half round trip (µs) of 64 B UDP datagrams between two Python processes on loopback."""
    try:
        return udp_pingpong(FLOOR_ADDRESSES, trips)
    except FloorError as exc:
        raise RunError(str(exc)) from None


# -- rounds -------------------------------------------------------------------------------------------------------

def record(results: dict[str, Series], rnd: int, keys: Sequence[str],
           measure: Callable[[], float | dict[str, float]]) -> None:
    """Run one measurement into results[key].values[rnd]; a failure is kept as that series' error."""
    series = [results[key] for key in keys]
    if any(s.unavailable for s in series):
        return
    started = time.perf_counter()
    try:
        value = measure()
    except Unavailable as exc:
        for s in series:
            s.unavailable = str(exc)
        log(f"  {keys[0]}: unavailable: {exc}")
        return
    except RunError as exc:
        for s in series:
            s.errors.append(f"round {rnd + 1}: {exc}")
        log(f"  {keys[0]}: FAILED: {exc}")
        return
    values = value if isinstance(value, dict) else {keys[0]: value}
    for key in keys:
        results[key].values[rnd] = values[key]
    shown = ", ".join(fmt(v) for v in values.values())
    log(f"  {', '.join(keys)}: {shown} ({time.perf_counter() - started:.1f} s)")


def run_round(rnd: int, trees: dict[str, Tree], plan: Plan, cwd: Path, results: dict[str, Series]) -> None:
    order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
    log(f"round {rnd + 1}/{plan.rounds}: {order[0]} first")
    new = trees["new"]
    for side in order:
        record(results, rnd, [f"perop/{side}"], functools.partial(bench_cpu, trees[side], cwd, 64, plan.perop_iters))
    record(results, rnd, ["batch/new"], functools.partial(bench_cpu, new, cwd, 64, plan.perop_iters, 32))
    for side in order:
        record(results, rnd, [f"static/{side}"],
               functools.partial(bench_cpu, trees[side], cwd, 64, plan.perop_iters, None, *STATIC))
    record(results, rnd, ["static_batch/new"],
           functools.partial(bench_cpu, new, cwd, 64, plan.perop_iters, 32, *STATIC))
    for side in order:
        record(results, rnd, [f"lat/{side}"], functools.partial(latency, trees[side], cwd, plan.lat_iters))
    record(results, rnd, ["lat_apart/new"],
           functools.partial(latency, new, cwd, plan.lat_iters, "--no-shared-emulator"))
    record(results, rnd, ["floor"], functools.partial(udp_floor, plan.floor_trips))
    for post_list, suffix in ((None, ""), (32, "_batch")):
        for qps, iters in ((16, plan.iters_16), (1024, plan.iters_1024)):
            record(results, rnd, [f"scale{qps}{suffix}/new"],
                   functools.partial(bench_cpu, new, cwd, qps, iters, post_list))
    if plan.datapath:
        for side in order:
            record(results, rnd, datapath_keys(trees[side]), functools.partial(datapath, trees[side], cwd))


def figures(plan: Plan) -> list[Figure]:
    found = [
        Figure("1 per-op CPU, 64 QPs x 32, 64 B write", "us/op", "perop/old", "perop/new", "old", "new", ("<=", 0.5)),
        Figure("2 batch CPU, --post-list 32", "us/op", "perop/old", "batch/new", "old per-op", "new batch",
               ("<=", 0.15)),
        Figure("1 per-op CPU, static WQEs (thor-bs-v2)", "us/op", "static/old", "static/new", "old", "new",
               ("<=", 0.5)),
        Figure("2 batch CPU, static WQEs (thor-bs-v2)", "us/op", "static/old", "static_batch/new", "old per-op",
               "new batch", ("<=", 0.15)),
        Figure("3 QP scaling, per-op (new)", "us/op", "scale16/new", "scale1024/new", "16 QPs", "1024 QPs",
               ("<=", 1.2)),
        Figure("3 QP scaling, batch (new)", "us/op", "scale16_batch/new", "scale1024_batch/new", "16 QPs",
               "1024 QPs", ("<=", 1.2)),
        Figure("4 latency, lat write t_typical", "us", "lat/old", "lat/new", "old", "new", ("<=", 0.8)),
        Figure("4 latency, new with an emulator process per NIC", "us", "lat/old", "lat_apart/new", "old",
               "new apart", None),
        Figure("4 latency floor, UDP ping-pong 64 B", "us", "floor", "lat/new", "floor", "new lat", None),
    ]
    if plan.datapath:
        found += [Figure(f"5 datapath {name.removeprefix('ratio_')}", "ratio", f"dp:{name}/old", f"dp:{name}/new",
                         "old", "new", (">=", NO_WORSE)) for name in DATAPATH_FIELDS]
    return found


# -- the report ---------------------------------------------------------------------------------------------------

def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def summarize(figure: Figure, results: dict[str, Series]) -> dict[str, Any]:
    base, test = results[figure.base], results[figure.test]
    base_median, test_median = median(base.values), median(test.values)
    ratio = test_median / base_median if test_median is not None and base_median else None
    per_round = [t / b if t is not None and b else None for b, t in zip(base.values, test.values)]
    verdict = "-"
    unavailable = test.unavailable or base.unavailable
    if unavailable:
        verdict = "unavailable"
    elif figure.target and ratio is not None:
        op, bound = figure.target
        verdict = "met" if (ratio <= bound if op == "<=" else ratio >= bound) else "MISSED"
    return {"title": figure.title, "unit": figure.unit, "base": figure.base, "test": figure.test,
            "base_label": figure.base_label, "test_label": figure.test_label,
            "base_values": base.values, "test_values": test.values, "base_median": base_median,
            "test_median": test_median, "ratio_of_medians": ratio, "per_round_ratios": per_round,
            "per_round_ratio_median": median(per_round),
            "target": f"{figure.target[0]} {figure.target[1]}" if figure.target else None, "verdict": verdict,
            "unavailable": unavailable, "errors": base.errors + test.errors}


def cells(row: dict[str, Any]) -> list[str]:
    def series(values: list[float | None], mid: float | None) -> str:
        return f"{' '.join(fmt(v) for v in values)} ({fmt(mid)})"
    return [row["title"], row["unit"], row["base_label"], series(row["base_values"], row["base_median"]),
            row["test_label"], series(row["test_values"], row["test_median"]), fmt(row["ratio_of_medians"]),
            series(row["per_round_ratios"], row["per_round_ratio_median"]), row["target"] or "", row["verdict"]]


def table(rows: list[dict[str, Any]], header: str) -> str:
    head = ["figure", "unit", "base", "rounds (median)", "test", "rounds (median)", "test/base",
            "per round (median)", "target", "verdict"]
    grid = [head] + [cells(row) for row in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(head))]
    lines = [header] + ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in grid]
    notes = [f"  {row['title']}: unavailable: {row['unavailable']}" for row in rows if row["unavailable"]]
    errors = sorted({f"  {row['title']}: {e}" for row in rows for e in row["errors"]})
    if notes or errors:
        lines += ["", "not measured:"] + notes + errors
    return "\n".join(lines)


# -- trees --------------------------------------------------------------------------------------------------------

def git(*args: str, check: bool = True) -> str:
    result = subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True, text=True,
                            timeout=120)
    if check and result.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {tail(result.stderr)}")
    return result.stdout.strip()


@contextlib.contextmanager
def worktree(commit: str, side: str, scratch: Path) -> Iterator[Tree]:
    """A detached worktree of `commit` under scratch, removed (and pruned) on the way out."""
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    path = scratch / side
    git("worktree", "add", "--detach", "--quiet", str(path), sha)
    try:
        yield Tree(side, path, f"{commit} ({sha[:10]})")
    finally:
        git("worktree", "remove", "--force", str(path), check=False)
        git("worktree", "prune", check=False)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        return Plan(1, 500, 500, 500, 1000, 50, not args.skip_datapath)
    return Plan(args.rounds, 2000, 2000, 2000, 4000, 200, not args.skip_datapath)


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    plan = make_plan(args)
    cwd = scratch / "cwd"
    cwd.mkdir()
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(worktree(args.old, "old", scratch))
        new = stack.enter_context(worktree(args.new, "new", scratch)) if args.new else Tree("new", ROOT,
                                                                                              "working tree")
        trees = {"old": old, "new": new}
        for tree in trees.values():
            try:
                check_import(tree, cwd)
            except RunError as exc:
                raise SystemExit(str(exc)) from None
        results: dict[str, Series] = {}
        for figure in figures(plan):
            for key in (figure.base, figure.test):
                results.setdefault(key, Series([None] * plan.rounds))
        started = time.perf_counter()
        for rnd in range(plan.rounds):
            run_round(rnd, trees, plan, cwd, results)
        seconds = time.perf_counter() - started
    rows = [summarize(figure, results) for figure in figures(plan)]
    return {"old": old.label, "new": f"{new.label} ({new.root})", "rounds": plan.rounds, "quick": args.quick,
            "plan": plan.__dict__, "seconds": seconds, "figures": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="81f8b3a", help="commit of the old code (default 81f8b3a)")
    parser.add_argument("--new", default=None, help="commit of the new code (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, old and new alternating (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round, fewer iterations (a smoke run)")
    parser.add_argument("--skip-datapath", action="store_true", help="skip figure 5 (bench/datapath.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every number")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="aiofabric-hotpath-"))
    try:
        report = measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        header = (f"hot path: new = {report['new']} vs old = {report['old']}, {report['rounds']} round(s)"
                  f"{' (quick)' if args.quick else ''}, {report['seconds']:.0f} s; driver CPU per op and latency")
        print(table(report["figures"], header))


if __name__ == "__main__":
    main()
