"""`aiofabric compare BASE RUN`: two saved results of one command side by side, figure by figure and row by row
(perftest's per size, nccl-tests' per type, op, root, size and placement), and the figures that got worse than the
tolerance allows (docs/command-line.md, compare). A result is a `--json` line (a file that holds it last, as a
captured stdout does) or bench's and lat's --out_json file; its schema version must be one this module reads."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

from .result_meta import SCHEMA_VERSION

KNOWN_SCHEMAS = (SCHEMA_VERSION,)  # the result schemas compare reads
HIGHER, LOWER = "higher", "lower"  # which way a figure is better
ABOUT = ("command_line", "host", "time", "aiofabric_version")  # what the report says of each file
ERROR_FIGURES = 5  # the regressions "error" names (one line); the figures list has them all


class CompareError(ValueError):
    """A file that cannot be compared (unreadable, not a result, another command's): a usage error naming it."""


@dataclasses.dataclass(frozen=True)
class Figure:
    key: str  # the result's key; "a.b" is key b of the object at a
    title: str  # as the command's table titles it, with its unit
    better: str | None  # HIGHER or LOWER; None: shown, never a regression (one sample, or a spread)
    scale: float = 1.0  # from the JSON's unit to the title's
    zero_is_none: bool = False  # 0 means "not measured" (perftest's BW peak)


@dataclasses.dataclass(frozen=True)
class Family:
    """What one kind of result compares: its rows' identity, its figures, the parameters worth naming when they
    differ, and the figures of the whole run (not of a row)."""
    name: str
    row_keys: tuple[str, ...]
    figures: tuple[Figure, ...]
    parameters: tuple[str, ...]
    totals: tuple[Figure, ...] = ()


BENCH = Family("bench", ("size",), (
    Figure("bw_MiBps", "BW average [MiB/sec]", HIGHER), Figure("bw_peak_MiBps", "BW peak [MiB/sec]", HIGHER,
                                                                zero_is_none=True),
    Figure("msg_rate", "MsgRate [Mpps]", HIGHER, 1e-6), Figure("lat_us.p50", "loaded lat p50 [usec]", LOWER),
    Figure("lat_us.p99", "loaded lat p99 [usec]", LOWER)),
    ("test", "qps", "depth", "post_list", "cq_mod", "inline_size", "mtu", "nics", "iterations", "duration"))
LAT = Family("lat", ("size",), (
    Figure("t_min_us", "t_min [usec]", LOWER), Figure("t_typical_us", "t_typical [usec]", LOWER),
    Figure("t_avg_us", "t_avg [usec]", LOWER), Figure("p99_us", "99% percentile [usec]", LOWER),
    Figure("p99_9_us", "99.9% percentile [usec]", LOWER), Figure("t_max_us", "t_max [usec]", None),
    Figure("t_stdev_us", "t_stdev [usec]", None)),
    ("test", "mtu", "warmup", "iterations", "latency"))
COLLECTIVE = Family("collective", ("type", "op", "root", "size", "placement"), (
    Figure("time_us", "time [us]", LOWER), Figure("algbw_GBps", "algbw [GB/s]", HIGHER),
    Figure("busbw_GBps", "busbw [GB/s]", HIGHER)),
    ("collective", "ranks", "nccl.iters", "nccl.agg", "nccl.warmup", "checked"),
    (Figure("avg_busbw_GBps", "Avg bus bandwidth [GB/s]", HIGHER),))


def parse_tolerance(text: str) -> float:
    """`5%` (a percentage) or `0.05` (a fraction below 1), as a fraction. A bare number of 1 or more is refused as
    ambiguous: `--tolerance 5` meant as 5% would otherwise pass a run 500% worse."""
    word = text.strip()
    percent = word.endswith("%")
    try:
        value = float(word[:-1] if percent else word)
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage (5%) or a fraction (0.05)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r}: a tolerance is a percentage (5%) or a fraction (0.05) of at least 0")
    if not percent and value >= 1:
        raise ValueError(f"{text!r} is ambiguous: write {word}% for {word} percent, or a fraction below 1 (0.05 is 5%)")
    return value / 100 if percent else value


def percent_text(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def load(path: str) -> dict[str, Any]:
    """The result in `path`: the file as one JSON object, else its last line (a captured stdout, lines before it)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CompareError(f"{path}: cannot read it: {exc}") from None
    if not text:
        raise CompareError(f"{path}: empty: no result in it")
    try:
        result = json.loads(text)
    except json.JSONDecodeError as whole:
        try:
            result = json.loads(text.splitlines()[-1])
        except json.JSONDecodeError:
            raise CompareError(f"{path}: not JSON: {whole}") from None
    if not isinstance(result, dict):
        raise CompareError(f"{path}: not a result: a JSON {type(result).__name__}, not an object")
    return result


def family_of(path: str, result: Mapping[str, Any]) -> Family:
    """Which figures `result` has, after checking it is a result of a schema compare reads, with figures."""
    version = result.get("schema_version")
    if version is None and "config" in result and "results" in result:
        raise CompareError(f"{path}: nccl-tests' -J document, not an aiofabric result: compare the --json output")
    if version is None:
        raise CompareError(f"{path}: no schema_version: not an aiofabric --json result (one written before schema "
                           "versions has none: run it again)")
    if isinstance(version, bool) or version not in KNOWN_SCHEMAS:
        raise CompareError(f"{path}: schema_version {version!r} is unknown here (this aiofabric reads "
                           f"{', '.join(map(str, KNOWN_SCHEMAS))}): compare with the aiofabric that wrote it")
    command = result.get("command")
    if command is None:
        raise CompareError(f"{path}: names no command ({result.get('error', 'the version line')}): nothing to compare")
    if result.get("server") is True:
        raise CompareError(f"{path}: a --server's summary: its client's result has the figures")
    if command == "bench":
        return BENCH
    if command == "lat":
        return LAT
    if "collective" in result:
        return COLLECTIVE
    raise CompareError(f"{path}: a result of {command} has no figures to compare (compare takes bench, lat and the "
                       "collectives)")


def _value(data: Any, key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, Mapping) else None
    return data


def _number(row: Mapping[str, Any], figure: Figure) -> float | None:
    """The figure in its title's unit, or None: absent, not a finite number, or 0 where 0 means not measured."""
    value = _value(row, figure.key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if figure.zero_is_none and value == 0:
        return None
    return value * figure.scale


def _rows(path: str, result: Mapping[str, Any], family: Family) -> dict[tuple[Any, ...], Mapping[str, Any]]:
    """The rows by their identity (a repeat of one, as -N runs the sweep again, is told by its count: n)."""
    rows = result.get("rows", [result] if "size" in result else [])
    if not isinstance(rows, list):
        raise CompareError(f"{path}: 'rows' is not a list")
    keyed: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CompareError(f"{path}: row {index} is not an object")
        missing = [key for key in family.row_keys if key not in row]
        if missing:
            raise CompareError(f"{path}: row {index} has no {' or '.join(missing)}")
        identity = tuple(row[key] for key in family.row_keys)
        odd = [key for key, value in zip(family.row_keys, identity) if not isinstance(value, (str, int, float))
               and value is not None]
        if odd:
            raise CompareError(f"{path}: row {index}: {' and '.join(odd)} is not a number or a name")
        n = 1
        while identity + (n,) in keyed:
            n += 1
        keyed[identity + (n,)] = row
    return keyed


def row_name(family: Family, identity: Sequence[Any]) -> dict[str, Any]:
    """A row's identity as JSON: its key fields (and n, for a repeat)."""
    if not identity:
        return {}
    name = dict(zip(family.row_keys, identity))
    return name if identity[-1] == 1 else {**name, "n": identity[-1]}


def judge(base: float | None, run: float | None, better: str | None, tolerance: float
          ) -> tuple[float | None, bool]:
    """(the relative change, or None where there is none: a figure missing, or a base of 0 that changed; whether
    `run` is worse than `base` beyond `tolerance`, a fraction of the base: of a base of 0, anything worse is)."""
    if base is None or run is None:
        return None, False
    change = (run - base) / abs(base) if base else (0.0 if run == base else None)
    if better is None:
        return change, False
    worse = base - run if better == HIGHER else run - base
    return change, worse > tolerance * abs(base)


def compare(files: Sequence[str], results: Sequence[Mapping[str, Any]], tolerance: float) -> dict[str, Any]:
    """BASE (first) and RUN side by side: every figure of every row in either, with its change and whether it is
    a regression; the rows only one has; the parameters that differ. "error" when a figure regressed or RUN
    failed."""
    (base_path, run_path), (base, run) = files, results
    families = [family_of(path, result) for path, result in zip(files, results)]
    family = families[0]
    if families[1] is not family or base.get("command") != run.get("command"):
        raise CompareError(f"{base_path} is a result of {base.get('command')}, {run_path} of {run.get('command')}: "
                           "compare two results of one command")
    if "test" in base and "test" in run and base["test"] != run["test"]:  # a failure's line may have no test
        raise CompareError(f"{base_path} is {family.name} {base.get('test')}, {run_path} {family.name} "
                           f"{run.get('test')}: compare two runs of one test")
    if base.get("ok") is not True:
        raise CompareError(f"{base_path}: the base run failed ({base.get('error', 'ok is not true')}): it is no "
                           "baseline")
    base_rows, run_rows = _rows(base_path, base, family), _rows(run_path, run, family)
    figures = []
    for identity in base_rows:
        if identity in run_rows:
            figures += _figures(family, family.figures, identity, base_rows[identity], run_rows[identity], tolerance)
    figures += _figures(family, family.totals, (), base, run, tolerance)
    first = [rows[next(iter(rows))] if rows else {} for rows in (base_rows, run_rows)]
    parameters = [{"name": name, "base": _value(first[0], name) if name in first[0] else _value(base, name),
                   "run": _value(first[1], name) if name in first[1] else _value(run, name)}
                  for name in family.parameters]
    report: dict[str, Any] = {
        "base": {"file": base_path, **{key: base.get(key) for key in ABOUT}},
        "run": {"file": run_path, **{key: run.get(key) for key in ABOUT}},
        "tolerance": tolerance, "figures": figures,
        "only_in_base": [row_name(family, key) for key in base_rows if key not in run_rows],
        "only_in_run": [row_name(family, key) for key in run_rows if key not in base_rows],
        "parameters_differ": [p for p in parameters if p["base"] != p["run"]],
        "regressions": sum(figure["regression"] for figure in figures),
    }
    problems = [f"{run_path}: the run failed: {run.get('error', 'ok is not true')}"] if run.get("ok") is not True \
        else []
    if report["regressions"]:
        worst = [f"{row_text(f['row'])} {f['title']} {change_text(f['change'], f['base'])}" for f in figures
                 if f["regression"]]
        more = [f"and {len(worst) - ERROR_FIGURES} more"] if len(worst) > ERROR_FIGURES else []
        problems.append(f"{len(worst)} figure(s) worse than the base by more than {percent_text(tolerance)}: "
                        + "; ".join(worst[:ERROR_FIGURES] + more))
    if problems:
        report["error"] = "; ".join(problems)
    return report


def _figures(family: Family, figures: Sequence[Figure], identity: Sequence[Any], base: Mapping[str, Any],
             run: Mapping[str, Any], tolerance: float) -> list[dict[str, Any]]:
    entries = []
    for figure in figures:
        before, after = _number(base, figure), _number(run, figure)
        change, regression = judge(before, after, figure.better, tolerance)
        entries.append({"row": row_name(family, identity), "figure": figure.key, "title": figure.title,
                        "base": before, "run": after, "change": change, "better": figure.better,
                        "regression": regression})
    return entries


def row_text(row: Mapping[str, Any]) -> str:
    if not row:
        return "all rows"
    repeat = f" #{row['n']}" if "n" in row else ""  # -N's later sweeps
    if set(row) <= {"size", "n"}:
        return f"size {row['size']}{repeat}"
    return f"{row['size']} B {row['type']} {row['op']} root {row['root']} {row['placement']}{repeat}"


def change_text(change: float | None, base: float | None) -> str:
    if change is None:
        return "from 0" if base == 0 else "-"
    return f"{change * 100:+.2f}%"


def _number_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def format_report(report: Mapping[str, Any]) -> str:
    """The comparison as text: each file's command line, host, time and version, the figures side by side, the
    rows only one file has, the parameters that differ, and the verdict."""
    lines = []
    for side in ("base", "run"):
        about = report[side]
        lines.append(f"{side + ':':<5} {about['file']}: {about['command_line']} (host {about['host']}, "
                     f"{about['time']}, aiofabric {about['aiofabric_version']})")
    tolerance = percent_text(report["tolerance"])
    lines.append(f"tolerance {tolerance}: a regression is a figure worse than the base by more than {tolerance} of "
                 "it (bandwidth and message rate lower, latency and time higher)")
    table = [("row", "figure", "base", "run", "change", "")]
    for figure in report["figures"]:
        verdict = "REGRESSION" if figure["regression"] else "" if figure["better"] else "(not judged)"
        table.append((row_text(figure["row"]), figure["title"], _number_text(figure["base"]),
                      _number_text(figure["run"]), change_text(figure["change"], figure["base"]), verdict))
    widths = [max(len(line[column]) for line in table) for column in range(5)]
    for line in table:
        lines.append(f"{line[0]:<{widths[0]}}  {line[1]:<{widths[1]}}  {line[2]:>{widths[2]}}  "
                     f"{line[3]:>{widths[3]}}  {line[4]:>{widths[4]}}  {line[5]}".rstrip())
    for side in ("base", "run"):
        if report[f"only_in_{side}"]:
            lines.append(f"only in {side} ({report[side]['file']}): "
                         + ", ".join(row_text(row) for row in report[f"only_in_{side}"]))
    for parameter in report["parameters_differ"]:
        lines.append(f"parameters differ: {parameter['name']} {parameter['base']} in base, {parameter['run']} in run")
    count = report["regressions"]
    lines.append(f"{count} regression{'s' * (count != 1)} beyond {tolerance}" if count else
                 f"no regression beyond {tolerance}")
    return "\n".join(lines)
