"""nccl-tests' output, line for line, so its log parsers read ours: the preamble (version, test, parameters, one
line per rank's device), the table's header and rows, the closing lines; and its JSON document (`-J FILE`,
JSON_FILE_VERSION 3). The formats are nccl-tests' src/util.cu's (writeDeviceReport, writeResultHeader,
writeBenchmarkLinePreamble/Body, writeResultFooter, jsonOutputInit). Pure.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

JSON_FILE_VERSION = 3
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
# our commands -> nccl-tests' binaries (the program its lines name)
PROGRAMS = {"allreduce": "all_reduce_perf", "reduce_scatter": "reduce_scatter_perf", "allgather": "all_gather_perf",
            "broadcast": "broadcast_perf", "reduce": "reduce_perf", "gather": "gather_perf",
            "scatter": "scatter_perf", "sendrecv": "sendrecv_perf", "alltoall": "alltoall_perf"}
BLOCKING = {1: "# Blocking Enabled: wait and barrier after each inner iteration (-m) ",
            2: "# Blocking Enabled: wait after each inner iteration (-m), no barrier ",
            3: "# Blocking Enabled: wait and barrier after each outer iteration (-n); time excludes barrier "}


def float_text(value: float, width: int) -> str:
    """getFloatStr: two decimals, or fewer, or an exponent, whatever fits `width`."""
    for form in (f"{value:{width}.2f}", f"{value:{width}.1f}", f"{value:{width}.0f}"):
        if len(form) <= width:
            return form
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


def device_line(device: Mapping[str, Any]) -> str:
    """One rank's line under "# Using devices" (what nccl-tests' parseRankInfo reads back)."""
    return (f"#  Rank {device['rank']:2d} Group {device['group']:2d} Pid {device['pid']:6d} on "
            f"{device['hostname']:>10} device {device['device']:2d} [{device['device_hex']}] {device['device_info']}")


def preamble(config: Mapping[str, Any], devices: Sequence[Mapping[str, Any]]) -> list[str]:
    """From "# nccl-tests version" to the devices. `config`: version, program, min_bytes, max_bytes, step_factor
    (1 for none), step_bytes, warmup, iters, agg, check, blocking."""
    step = (f"{config['step_factor']}(factor)" if config["step_factor"] > 1 else f"{config['step_bytes']}(bytes)")
    lines = [f"# nccl-tests version {config['version']} nccl-headers=0 nccl-library=0",
             f"# Collective test starting: {config['program']}",
             f"# nThread 1 nGpus 1 minBytes {config['min_bytes']} maxBytes {config['max_bytes']} step: {step} "
             f"warmup iters: {config['warmup']} iters: {config['iters']} agg iters: {config['agg']} validation: "
             f"{config['check']} graph: 0 unalign: 0"]
    if config["blocking"] in BLOCKING:
        lines.append(BLOCKING[config["blocking"]])
    return [*lines, "#", "# Using devices", *(device_line(device) for device in devices)]


def header() -> list[str]:
    blank = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
    columns = "  {:>7}  {:>6}  {:>6}  {:>6}"
    return ["#", blank + "           out-of-place                       in-place          ",
            f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
            + columns.format("time", "algbw", "busbw", "#wrong") * 2 + " ",
            f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
            + columns.format("(us)", "(GB/s)", "(GB/s)", "") * 2 + " "]


def row_start(size: int, count: int, type_name: str, op_name: str, root: int) -> str:
    return f"{size:12d}  {count:12d}  {type_name:>8}  {op_name:>6}  {root:6d}"


def row_body(time_us: float, algbw: float, busbw: float, wrong: int | None) -> str:
    """One placement's columns; `wrong` None: not checked (N/A)."""
    numbers = f"  {float_text(time_us, 7):>7}  {float_text(algbw, 6):>6}  {float_text(busbw, 6):>6}"
    return numbers + ("    N/A" if wrong is None else f"  {_g(wrong):>6}")


def footer(errors: int, avg_busbw: float, min_bw: float | None, program: str) -> list[str]:
    """The closing lines: failed tests (sizes x placements with a wrong element), the mean busbw (checked against
    NCCL_TESTS_MIN_BW: below 90% of it fails), and the end."""
    verdict = "" if min_bw is None else "FAILED" if avg_busbw < min_bw * 0.9 else "OK"
    return [f"# {'Out of bounds values':<20} : {errors} {'FAILED' if errors else 'OK'}",
            f"# {'Avg bus bandwidth':<20} : {_g(avg_busbw)} {verdict}", "#",
            f"# Collective test concluded: {program}", "#", ""]


def json_document(config: Mapping[str, Any], devices: Sequence[Mapping[str, Any]], result: Mapping[str, Any], *,
                  args: Sequence[str], env: Sequence[str], start_time: str, end_time: str) -> dict[str, Any]:
    """nccl-tests' -J document: its keys, and its quirks (booleans as the strings "true"/"false", the root as
    its padded column text, times and bandwidths as numbers)."""
    def placement(row: Mapping[str, Any]) -> dict[str, Any]:
        return {"time": row["time_us"], "alg_bw": row["algbw_GBps"], "bus_bw": row["busbw_GBps"],
                "nwrong": None if row["wrong"] is None else float(row["wrong"])}
    results = []
    for out_of_place, in_place in zip(result["rows"][::2], result["rows"][1::2]):
        results.append({"size": out_of_place["size"], "count": out_of_place["count"], "type": out_of_place["type"],
                        "redop": out_of_place["op"], "root": f"{out_of_place['root']:6d}",
                        "out_of_place": placement(out_of_place), "in_place": placement(in_place),
                        "actual_iterations": config["iters"], "experiment_name": ""})
    step = ({"step_factor": config["step_factor"]} if config["step_factor"] > 1 else
            {"step_bytes": config["step_bytes"]})
    min_bw = result.get("min_bw_GBps")
    return {"version": JSON_FILE_VERSION, "start_time": start_time, "args": list(args), "env": list(env),
            "nccl_version": 0,
            "config": {"nthreads": 1, "ngpus": 1, "minimum_bytes": config["min_bytes"],
                       "maximum_bytes": config["max_bytes"], **step, "warmup_iters": config["warmup"],
                       "iterations": config["iters"], "aggregated_iterations": config["agg"],
                       "validation": config["check"], "graph": 0,
                       "blocking_collectives": _bool(config["blocking"] != 0), "per_iter_timing": "false",
                       "per_iter_skip": 0, "parallel_init": "false", "devices": [dict(d) for d in devices]},
            "results": results,
            "out_of_bounds": {"count": result["out_of_bounds"], "okay": _bool(result["out_of_bounds"] == 0)},
            "average_bus_bandwidth": {"bandwidth": result["avg_busbw_GBps"],
                                      "okay": "unchecked" if min_bw is None else
                                      _bool(result["avg_busbw_GBps"] >= min_bw * 0.9)},
            "errors": [], "end_time": end_time}


def _g(value: float) -> str:
    """C's %g."""
    return "%g" % value


def _bool(value: bool) -> str:
    return "true" if value else "false"
