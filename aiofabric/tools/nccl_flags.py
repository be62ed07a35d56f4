"""nccl-tests' flags (its src/common.cu main and README) on the collectives' commands, with nccl-tests' defaults:
what each means here, which values we take, and, for the flags about CUDA, threads or GPUs, the reason each value
but nccl-tests' default is refused (exit 2). And NCCL_TESTS_MIN_BW."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from typing import Any

from .arguments import integer, sized
from ..collectives.layout import DTYPE_NAMES

# nccl-tests' -d all and -o all, in its order (test_typenames, test_opnames): bfloat16 where ml_dtypes is installed
# (numpy has no such type; nccl-tests too leaves out what its CUDA lacks), mulsum is refused below
HAVE_BFLOAT16 = importlib.util.find_spec("ml_dtypes") is not None
ALL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
             *(("bfloat16",) if HAVE_BFLOAT16 else ()))
ALL_OPS = ("sum", "prod", "max", "min", "avg")
MAX_SWEEP = 4096  # sizes in one sweep: -i 1 from 1 byte to 1G would never end
# flag, long name, the value nccl-tests defaults to (the only one taken), why another is refused
REFUSED = (
    ("-G", "--cudagraph", "0", "CUDA graphs capture GPU kernels; here each collective is a compiled batch already "
                               "(replayed, not captured)"),
    ("-C", "--report_cputime", "0", "the time reported here is the host's wall clock already: there is no GPU "
                                    "time to report instead"),
    ("-R", "--local_register", "0", "NCCL buffer registration: the communicator's buffers are always registered "
                                    "memory regions"),
    ("-D", "--device_implementation", "0", "NCCL's device API kernels run on GPUs"),
    ("-V", "--device_cta_count", "16", "CTAs are GPU thread blocks"),
    ("-x", "--cta_policy", None, "NCCL's CTA policy is about GPU thread blocks"),
    ("-y", "--stream_null", "0", "CUDA streams: there are none here"),
    ("-M", "--memory", "0", "the report is of GPU memory"),
    ("-u", "--unalign", "0", "the registered buffers are the driver's, aligned; misaligning the user's arrays is "
                             "not implemented"),
    ("-I", "--per_iter_timing", "0", "per-iteration timings are CUDA events; not implemented here"),
    ("-K", "--per_iter_skip", "0", "it goes with -I, which is not implemented here"),
    ("-p", "--parallel_init", "0", "there are no threads to initialise NCCL in parallel: each rank opens its NIC"),
    ("-S", "--report_timestamps", "0", "not implemented here"),
    ("-T", "--test_timeout", "0", "use --timeout SECONDS (how long one collective may take)"),
)
ONE_WHY = {"-t": "nccl-tests' threads per process: here each process runs its ranks on one event loop; more "
                 "ranks are --ranks N (in this process) or one per process under a launcher",
           "-g": "nccl-tests' GPUs per thread: here a rank is one NIC; more ranks are --ranks N (in this process) "
                 "or one per process under a launcher"}


def add_nccl_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("-t", "--nthreads", type=int, default=1, help="threads per process: 1 (nccl-tests' default; others refused)")
    add("-g", "--ngpus", type=int, default=1, help="GPUs per thread: 1 (nccl-tests' default; others refused)")
    add("-b", "--minbytes", type=sized(1), default=32 << 20,
        help="smallest size (default 32M); K/M/G suffixes are powers of 1024")
    add("-e", "--maxbytes", type=sized(1), default=32 << 20, help="largest size (default 32M)")
    add("-i", "--stepbytes", type=sized(1), default=1 << 20,
        help="add this to the size each step, when -f is 1 (default 1M)")
    add("-f", "--stepfactor", type=integer(1), default=1,
        help="multiply the size by this each step (default 1: step by -i instead)")
    add("--size", type=sized(1), help="one size instead of a sweep")
    add("-n", "--iters", type=integer(0), default=20, help="timed iterations per size (default 20)")
    add("-m", "--agg_iters", type=integer(1), default=1, help="collectives per timed iteration (default 1)")
    add("-w", "--warmup_iters", type=integer(0), default=1,
        help="untimed runs of every size first, doubling from -b (default 1)")
    add("-N", "--run_cycles", type=integer(0), default=1, help="run the sweep this many times (default 1; 0: until "
                                                               "interrupted)")
    add("-d", "--datatype", default="float", choices=[*sorted(DTYPE_NAMES), "all"],
        help="element type, or all of them (default float)")
    add("-o", "--op", default="sum", choices=(*ALL_OPS, "mulsum", "all"),
        help="reduction, or all of them (default sum)")
    add("-r", "--root", default="0", help="the root rank of broadcast, reduce, gather, scatter; all (or -1): every "
                                          "rank in turn (default 0)")
    add("-c", "--check", dest="verify", type=integer(0), default=1,
        help="check runs per size, each on fresh inputs, every element checked (default 1; 0: none)")
    add("-z", "--blocking", type=integer(0, 3), default=0,
        help="0 and 2: every collective is waited for (always, here); 1: and a barrier after each; 3: a barrier "
             "after each iteration, not timed (default 0)")
    add("-a", "--average", type=integer(0, 3), default=1,
        help="the time reported: 0 rank 0's, 1 the ranks' mean, 2 least, 3 most (default 1)")
    add("-J", "--output_file", metavar="FILE.json", help="also write nccl-tests' JSON document to FILE.json (never "
                                                         "overwritten: FILE.json.0, .1, ... if it exists)")
    for flag, name, default, why in REFUSED:
        add(flag, name, metavar="N", help=argparse.SUPPRESS)


def check_nccl_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, ranks: int) -> None:
    """Refuse what cannot run here, naming the flag and why; set args.sizes, warmup_sizes, dtypes, ops, roots,
    min_bw (NCCL_TESTS_MIN_BW, GB/s, or None)."""
    for flag, value in (("-t", args.nthreads), ("-g", args.ngpus)):
        if value != 1:
            parser.error(f"{flag} {value}: only 1 is taken ({ONE_WHY[flag]})")
    for flag, name, default, why in REFUSED:
        value = getattr(args, name.lstrip("-"))
        if value is not None and value != default:
            parser.error(f"{flag}/{name} {value}: not taken here: {why}" + (
                f" (only its default, {default})" if default is not None else ""))
    if args.datatype == "bfloat16" and not HAVE_BFLOAT16:
        parser.error("-d bfloat16: numpy has no bfloat16 type; it takes the ml_dtypes package (pip install "
                     "'aiofabric[bf16]')")
    if args.op == "mulsum":
        parser.error("-o mulsum: NCCL's ncclRedOpCreatePreMulSum (each input scaled before the sum) is not "
                     "implemented here")
    if args.size is None and args.minbytes > args.maxbytes:
        parser.error(f"-b/--minbytes {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}: a sweep goes up")
    if args.size is not None:
        args.sizes = [args.size]
    else:
        steps = (math.floor(math.log(args.maxbytes / args.minbytes, args.stepfactor)) if args.stepfactor > 1
                 else (args.maxbytes - args.minbytes) // args.stepbytes)
        if steps >= MAX_SWEEP:
            parser.error(f"-b {args.minbytes} to -e {args.maxbytes} by {_step(args)} is {steps + 1} sizes; at most "
                         f"{MAX_SWEEP} (use a larger -i or -f)")
        args.sizes = [args.minbytes]
        while (grown := _next(args, args.sizes[-1])) <= args.maxbytes:
            args.sizes.append(grown)
    low, high = min(args.sizes), max(args.sizes)
    args.warmup_sizes = [low << k for k in range(max(high // low, 1).bit_length()) if low << k <= high]
    args.dtypes = [DTYPE_NAMES[name] for name in (ALL_TYPES if args.datatype == "all" else (args.datatype,))]
    args.ops = list(ALL_OPS if args.op == "all" else (args.op,))
    if args.root in ("all", "-1"):
        args.roots = list(range(ranks))
    else:
        try:
            root = int(args.root, 10)
        except ValueError:
            parser.error(f"-r/--root {args.root!r}: a rank, or all (-1)")
        if not 0 <= root < ranks:
            parser.error(f"-r/--root {root}: must be a rank in [0, {ranks - 1}] ({ranks} ranks), or all (-1)")
        args.roots = [root]
    if args.output_file is not None and not args.output_file.lower().endswith(".json"):
        parser.error(f"-J {args.output_file}: nccl-tests writes JSON only, to a file named *.json")
    text = os.environ.get("NCCL_TESTS_MIN_BW")
    args.min_bw = None
    if text is not None:
        try:
            args.min_bw = float(text)
        except ValueError:
            parser.error(f"NCCL_TESTS_MIN_BW={text!r}: not a number (GB/s of average bus bandwidth)")
        if not math.isfinite(args.min_bw) or args.min_bw < 0:
            parser.error(f"NCCL_TESTS_MIN_BW={text}: must be a finite number of GB/s, at least 0")


def nccl_config(args: argparse.Namespace, version: str, program: str) -> dict[str, Any]:
    """What the preamble and the -J document say of the run."""
    return {"version": version, "program": program, "min_bytes": min(args.sizes), "max_bytes": max(args.sizes),
            "step_factor": args.stepfactor, "step_bytes": args.stepbytes, "warmup": args.warmup_iters,
            "iters": args.iters, "agg": args.agg_iters, "check": args.verify, "blocking": args.blocking}


def _next(args: argparse.Namespace, size: int) -> int:
    return size * args.stepfactor if args.stepfactor > 1 else size + args.stepbytes


def _step(args: argparse.Namespace) -> str:
    return f"x{args.stepfactor}" if args.stepfactor > 1 else f"+{args.stepbytes}"
