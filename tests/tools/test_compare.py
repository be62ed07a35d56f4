"""`aiofabric compare BASE RUN`: the figures side by side, exit 1 on one worse than the tolerance allows (or a failed
RUN), exit 2 on files that cannot be compared, naming the file or flag; rows only one file has are listed."""
import copy
import json

import pytest

from aiofabric.tools import cli
from aiofabric.tools.compare import CompareError, compare, format_report, judge, load, parse_tolerance
from aiofabric.tools.result_meta import metadata, stamped
from tests.support.results import assert_valid


def bench_row(size, bw, rate, p50=10.0, p99=20.0, peak=None):
    return {"verified": True, "test": "write", "qps": 1, "size": size, "iterations": 100, "duration": None,
            "depth": 128, "post_list": 1, "cq_mod": 100, "inline_size": 0, "mtu": 4096, "nics": 2,
            "msg_rate": rate, "bw_MiBps": bw, "bw_peak_MiBps": bw if peak is None else peak,
            "lat_us": {"p50": p50, "p99": p99}}


def result(command, argv=(), **keys):
    return stamped("error" not in keys, metadata([command, *argv], command, "2026-12-05T10:00:00Z"), keys)


def bench(*rows, **keys):
    return result("bench", ["write"], test="write", sizes=[row.get("size") for row in rows], rows=list(rows), **keys)


def lat(**figures):
    base = {"t_min_us": 5.0, "t_max_us": 50.0, "t_typical_us": 6.0, "t_avg_us": 7.0, "t_stdev_us": 1.0,
            "p99_us": 9.0, "p99_9_us": 12.0}
    return result("lat", ["write"], test="write", size=2, iterations=1000, mtu=4096, warmup=8, latency="one-way",
                  **{**base, **figures})


def collective(command="allreduce", rows=None, avg=1.0, **keys):
    rows = rows if rows is not None else [
        {"size": 1024, "count": 256, "type": "float", "op": "sum", "root": -1, "placement": placement,
         "time_us": 100.0, "algbw_GBps": 1.0, "busbw_GBps": 1.0, "wrong": 0} for placement in ("out-of-place",
                                                                                                "in-place")]
    return result(command, collective=command, ranks=2, rows=rows, avg_busbw_GBps=avg, checked=True,
                  nccl={"iters": 20, "agg": 1, "warmup": 1}, **keys)


def figures(report, figure=None):
    return [f for f in report["figures"] if figure is None or f["figure"] == figure]


def cli_compare(tmp_path, base, run, *flags, capsys):
    paths = []
    for name, data in (("base.json", base), ("run.json", run)):
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        paths.append(str(path))
    code = cli.main(["compare", *paths, *flags])
    out = capsys.readouterr()
    return code, out, paths


# -- the tolerance -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("5%", 0.05), ("0.05", 0.05), ("0", 0.0), ("0%", 0.0), ("12.5%", 0.125),
                                        ("150%", 1.5), (" 5% ", 0.05), ("0.999", 0.999)])
def test_a_tolerance_is_a_percentage_or_a_fraction_below_one(text, value):
    assert parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text,message", [
    ("5", "'5' is ambiguous: write 5% for 5 percent, or a fraction below 1 (0.05 is 5%)"),
    ("1", "'1' is ambiguous: write 1% for 1 percent, or a fraction below 1 (0.05 is 5%)"),
    ("-1%", "'-1%': a tolerance is a percentage (5%) or a fraction (0.05) of at least 0"),
    ("nan", "'nan': a tolerance is a percentage (5%) or a fraction (0.05) of at least 0"),
    ("inf%", "'inf%': a tolerance is a percentage (5%) or a fraction (0.05) of at least 0"),
    ("five", "'five' is not a percentage (5%) or a fraction (0.05)"),
    ("5%%", "'5%%' is not a percentage (5%) or a fraction (0.05)"),
    ("", "'' is not a percentage (5%) or a fraction (0.05)"),
])
def test_a_malformed_tolerance_is_refused_saying_how_to_write_it(text, message):
    with pytest.raises(ValueError) as caught:
        parse_tolerance(text)
    assert str(caught.value) == message


@pytest.mark.parametrize("spelling", [["--tolerance", "5%"], ["--tolerance=5%"], ["--tolerance", "0.05"]])
def test_every_spelling_of_the_tolerance_works(tmp_path, capsys, spelling):
    code, out, _ = cli_compare(tmp_path, bench(bench_row(64, 100.0, 1e6)), bench(bench_row(64, 95.0, 1e6)),
                               *spelling, "--json", capsys=capsys)
    line = json.loads(out.out)
    assert code == 0 and line["tolerance"] == 0.05 and line["regressions"] == 0


def test_a_malformed_tolerance_is_a_usage_error_naming_the_flag(tmp_path, capsys):
    code, out, _ = cli_compare(tmp_path, bench(bench_row(64, 100.0, 1e6)), bench(bench_row(64, 95.0, 1e6)),
                               "--tolerance", "5", "--json", capsys=capsys)
    assert code == 2 and json.loads(out.out)["error"] == (
        "usage: argument --tolerance: '5' is ambiguous: write 5% for 5 percent, or a fraction below 1 (0.05 is 5%)")


# -- the judgement -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base,run,better,change,regression", [
    (100.0, 95.0, "higher", -0.05, False),  # exactly the tolerance: not beyond it
    (100.0, 94.99, "higher", -0.0501, True),
    (100.0, 200.0, "higher", 1.0, False),
    (100.0, 105.0, "lower", 0.05, False),
    (100.0, 105.01, "lower", 0.0501, True),
    (100.0, 50.0, "lower", -0.5, False),
    (0.0, 0.0, "higher", 0.0, False),  # a base of 0: no division
    (0.0, 0.0, "lower", 0.0, False),
    (0.0, 3.0, "higher", None, False),  # better than 0
    (0.0, 3.0, "lower", None, True),  # worse than 0: 5% of 0 is 0
    (100.0, 0.0, "higher", -1.0, True),
    (50.0, 500.0, None, 9.0, False),  # not judged
    (None, 5.0, "lower", None, False), (5.0, None, "lower", None, False),  # missing: shown, not judged
])
def test_judge(base, run, better, change, regression):
    got_change, got_regression = judge(base, run, better, 0.05)
    assert got_regression is regression
    assert got_change == (None if change is None else pytest.approx(change))


def test_bench_figures_side_by_side_higher_or_lower_is_better():
    base = bench(bench_row(64, 100.0, 2e6, p50=10.0, p99=20.0), bench_row(4096, 1000.0, 0.25e6))
    run = bench(bench_row(64, 90.0, 2.2e6, p50=10.4, p99=30.0), bench_row(4096, 1000.0, 0.25e6))
    report = compare(["b.json", "r.json"], [base, run], 0.05)
    assert [(f["row"], f["figure"]) for f in figures(report)][:5] == [
        ({"size": 64}, "bw_MiBps"), ({"size": 64}, "bw_peak_MiBps"), ({"size": 64}, "msg_rate"),
        ({"size": 64}, "lat_us.p50"), ({"size": 64}, "lat_us.p99")]
    regressed = {(f["row"]["size"], f["figure"]) for f in figures(report) if f["regression"]}
    assert regressed == {(64, "bw_MiBps"), (64, "bw_peak_MiBps"), (64, "lat_us.p99")}  # p50 +4%: within
    rate = figures(report, "msg_rate")[0]
    assert (rate["base"], rate["run"], rate["better"]) == (2.0, pytest.approx(2.2), "higher")  # in Mpps
    assert report["regressions"] == 3
    assert report["error"].startswith("3 figure(s) worse than the base by more than 5%: ")
    assert "size 64 loaded lat p99 [usec] +50.00%" in report["error"]
    assert_valid(stamped(False, metadata(["compare"], "compare", "2026-12-05T10:00:00Z"), report))


def test_the_error_names_the_first_five_regressions():
    sizes = [2 ** k for k in range(4)]
    base = bench(*(bench_row(size, 100.0, 1e6) for size in sizes))
    run = bench(*(bench_row(size, 50.0, 1e6) for size in sizes))
    report = compare(["b", "r"], [base, run], 0.05)
    assert report["regressions"] == 8 and report["error"].endswith(
        "size 1 BW average [MiB/sec] -50.00%; size 1 BW peak [MiB/sec] -50.00%; size 2 BW average [MiB/sec] -50.00%; "
        "size 2 BW peak [MiB/sec] -50.00%; size 4 BW average [MiB/sec] -50.00%; and 3 more")


def test_a_peak_of_0_is_not_measured_and_not_a_regression():
    """perftest prints BW peak 0 where it measures none (-D, -N, past its sample limit)."""
    report = compare(["b", "r"], [bench(bench_row(64, 100.0, 1e6)), bench(bench_row(64, 100.0, 1e6, peak=0.0))], 0.05)
    peak = figures(report, "bw_peak_MiBps")[0]
    assert (peak["run"], peak["change"], peak["regression"], report["regressions"]) == (None, None, False, 0)


def test_rows_only_in_one_file_are_listed_not_dropped():
    base = bench(bench_row(64, 100.0, 1e6), bench_row(128, 100.0, 1e6))
    run = bench(bench_row(128, 100.0, 1e6), bench_row(256, 100.0, 1e6))
    report = compare(["b.json", "r.json"], [base, run], 0.05)
    assert report["only_in_base"] == [{"size": 64}] and report["only_in_run"] == [{"size": 256}]
    assert {f["row"]["size"] for f in figures(report)} == {128} and "error" not in report
    text = format_report(report)
    assert "only in base (b.json): size 64" in text and "only in run (r.json): size 256" in text


def test_differing_parameters_are_named():
    run = bench(dict(bench_row(64, 100.0, 1e6), qps=4, iterations=400))
    report = compare(["b", "r"], [bench(bench_row(64, 100.0, 1e6)), run], 0.05)
    assert report["parameters_differ"] == [{"name": "qps", "base": 1, "run": 4},
                                           {"name": "iterations", "base": 100, "run": 400}]
    assert "parameters differ: qps 1 in base, 4 in run" in format_report(report)


def test_lat_percentiles_lower_is_better_t_max_is_shown_not_judged():
    report = compare(["b", "r"], [lat(), lat(p99_9_us=13.0, t_max_us=500.0, t_typical_us=5.0)], 0.05)
    judged = {f["figure"]: (f["regression"], f["better"]) for f in figures(report)}
    assert judged["p99_9_us"] == (True, "lower") and judged["t_typical_us"] == (False, "lower")
    assert judged["t_max_us"] == (False, None) and report["regressions"] == 1
    assert "(not judged)" in format_report(report)


def test_collectives_rows_by_type_op_root_size_and_placement_and_the_average():
    base = collective()
    run = copy.deepcopy(base)
    run["rows"][1]["time_us"], run["rows"][1]["busbw_GBps"], run["avg_busbw_GBps"] = 200.0, 0.5, 0.75
    report = compare(["b", "r"], [base, run], 0.05)
    regressed = [(f["row"].get("placement"), f["figure"]) for f in figures(report) if f["regression"]]
    assert regressed == [("in-place", "time_us"), ("in-place", "busbw_GBps"), (None, "avg_busbw_GBps")]
    assert figures(report, "avg_busbw_GBps")[0]["row"] == {}
    text = format_report(report)
    assert "1024 B float sum root -1 in-place" in text and "all rows" in text and "3 regressions beyond 5%" in text


def test_a_repeated_sweep_is_told_apart():
    """-N 2 runs the sweep twice: the second row of a size is its own row (n 2), not the first's."""
    rows = collective()["rows"] * 2
    report = compare(["b", "r"], [collective(rows=rows), collective(rows=rows[:2])], 0.05)
    assert report["only_in_base"] == [{"type": "float", "op": "sum", "root": -1, "size": 1024,
                                       "placement": placement, "n": 2} for placement in ("out-of-place", "in-place")]
    assert "#2" in format_report(report)


def test_a_failed_run_is_a_failure_and_its_figures_still_shown():
    run = bench(bench_row(64, 100.0, 1e6), error="verification failed: a byte differs")
    report = compare(["b.json", "r.json"], [bench(bench_row(64, 100.0, 1e6)), run], 0.05)
    assert report["error"] == "r.json: the run failed: verification failed: a byte differs"
    assert len(figures(report)) == 5 and report["regressions"] == 0


def test_a_run_that_failed_before_its_figures_is_a_failure_listing_every_row(tmp_path, capsys):
    failed = result("bench", ["write"], error="LinkDownError: sim:x: the link stayed down")
    code, out, (_, run_path) = cli_compare(tmp_path, bench(bench_row(64, 1.0, 1.0)), failed, capsys=capsys)
    assert code == 1 and "only in base" in out.out
    assert out.err == f"aiofabric compare: {run_path}: the run failed: LinkDownError: sim:x: the link stayed down\n"


# -- what cannot be compared: exit 2, naming the file --------------------------------------------------------------

@pytest.mark.parametrize("base,run,message", [
    (bench(bench_row(64, 1.0, 1.0)), lat(), "{base} is a result of bench, {run} of lat: compare two results of "
                                            "one command"),
    (collective("allreduce"), collective("allgather"), "{base} is a result of allreduce, {run} of allgather: "
                                                       "compare two results of one command"),
    (bench(bench_row(64, 1.0, 1.0)), result("bench", test="read", rows=[dict(bench_row(64, 1.0, 1.0), test="read")]),
     "{base} is bench write, {run} bench read: compare two runs of one test"),
    (bench(bench_row(64, 1.0, 1.0)), "{not json", "{run}: not JSON: Expecting property name enclosed in double quotes: "
                                                  "line 1 column 2 (char 1)"),
    (bench(bench_row(64, 1.0, 1.0)), "", "{run}: empty: no result in it"),
    (bench(bench_row(64, 1.0, 1.0)), "[1, 2]", "{run}: not a result: a JSON list, not an object"),
    ({k: v for k, v in bench(bench_row(64, 1.0, 1.0)).items() if k != "schema_version"}, bench(bench_row(64, 1.0, 1.0)),
     "{base}: no schema_version: not an aiofabric --json result (one written before schema versions has none: run "
     "it again)"),
    (bench(bench_row(64, 1.0, 1.0)), {**bench(bench_row(64, 1.0, 1.0)), "schema_version": 2},
     "{run}: schema_version 2 is unknown here (this aiofabric reads 1): compare with the aiofabric that wrote it"),
    (bench(bench_row(64, 1.0, 1.0)), {**bench(bench_row(64, 1.0, 1.0)), "schema_version": True},
     "{run}: schema_version True is unknown here (this aiofabric reads 1): compare with the aiofabric that wrote it"),
    ({"version": 3, "config": {}, "results": []}, collective(), "{base}: nccl-tests' -J document, not an aiofabric "
                                                                "result: compare the --json output"),
    (result("bench", server=True, port=1, refused=0, client_error=None), bench(bench_row(64, 1.0, 1.0)),
     "{base}: a --server's summary: its client's result has the figures"),
    (bench(bench_row(64, 1.0, 1.0)), {**result("bench", error="usage: x"), "command": None},
     "{run}: names no command (usage: x): nothing to compare"),
    (result("info", nic="sim"), result("info", nic="sim"), "{base}: a result of info has no figures to compare "
                                                           "(compare takes bench, lat and the collectives)"),
    (bench(bench_row(64, 1.0, 1.0), error="boom"), bench(bench_row(64, 1.0, 1.0)),
     "{base}: the base run failed (boom): it is no baseline"),
    (bench(bench_row(64, 1.0, 1.0)), bench({"bw_MiBps": 1.0}), "{run}: row 0 has no size"),
    (bench(bench_row(64, 1.0, 1.0)), {**bench(bench_row(64, 1.0, 1.0)), "rows": {"size": 64}},
     "{run}: 'rows' is not a list"),
    (bench({**bench_row(64, 1.0, 1.0), "size": [64]}), bench(bench_row(64, 1.0, 1.0)),
     "{base}: row 0: size is not a number or a name"),
], ids=["commands", "collectives", "tests", "not-json", "empty", "not-an-object", "no-schema-version",
        "unknown-schema-version", "schema-version-bool", "nccl-tests-document", "server", "no-command", "info",
        "failed-base",
        "row-without-size", "rows-not-a-list", "size-a-list"])
def test_files_that_cannot_be_compared_are_a_usage_error_naming_them(tmp_path, capsys, base, run, message):
    code, out, (base_path, run_path) = cli_compare(tmp_path, base, run, capsys=capsys)
    assert code == 2 and out.err.endswith(f"aiofabric compare: error: {message.format(base=base_path, run=run_path)}\n")


def test_an_unreadable_file_is_named(tmp_path, capsys):
    code = cli.main(["compare", str(tmp_path / "missing.json"), str(tmp_path / "missing.json"), "--json"])
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and error.startswith(f"usage: {tmp_path / 'missing.json'}: cannot read it: [Errno 2] No such file")


def test_a_captured_stdout_is_read_by_its_last_line(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("# Writing JSON output to x.json\n" + json.dumps(collective()) + "\n")
    assert load(str(path))["collective"] == "allreduce"
    path.write_text("text\nmore text\n")
    with pytest.raises(CompareError, match="out.txt: not JSON: Expecting value: line 1 column 1"):
        load(str(path))


# -- the exit codes and the text -----------------------------------------------------------------------------------

def test_exit_0_without_regression_1_with_one_and_the_text_says_which(tmp_path, capsys):
    base = bench(bench_row(64, 100.0, 1e6))
    code, out, _ = cli_compare(tmp_path, base, bench(bench_row(64, 99.0, 1e6)), capsys=capsys)
    assert code == 0 and out.out.rstrip().endswith("no regression beyond 5%") and out.err == ""
    assert "base: " in out.out and "aiofabric bench write (host " in out.out
    code, out, _ = cli_compare(tmp_path, base, bench(bench_row(64, 80.0, 1e6)), "--tolerance=10%", capsys=capsys)
    line = next(line for line in out.out.splitlines() if line.startswith("size 64  BW average"))
    assert code == 1 and line.split()[-2:] == ["-20.00%", "REGRESSION"]
    assert out.out.rstrip().endswith("2 regressions beyond 10%")  # BW average and peak
    assert out.err == ("aiofabric compare: 2 figure(s) worse than the base by more than 10%: size 64 BW average "
                       "[MiB/sec] -20.00%; size 64 BW peak [MiB/sec] -20.00%\n")


def test_a_base_of_zero_is_shown_and_judged_without_dividing(tmp_path, capsys):
    base, run = collective(), collective()
    base["rows"][0]["time_us"] = 0.0
    code, out, _ = cli_compare(tmp_path, base, run, capsys=capsys)
    line = next(line for line in out.out.splitlines() if "out-of-place  time [us]" in line)
    assert code == 1 and line.split()[-4:] == ["100", "from", "0", "REGRESSION"]
