"""What a perftest log parser reads from `aiofabric bench` and `lat`: perftest's own format strings (copied here from
its src/perftest_parameters.h, as C), its table read the way scripts read it, its --out_json keys, its BW peak and
average (print_report_bw), and its defaults."""
import json
import random
import re
import subprocess
import sys

import pytest

from aiofabric.tools import cli, perftest_flags
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.bench_report import table_head
from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.peak import Timeline, fastest
from aiofabric.tools.perftest_format import bw_header, bw_row, lat_row

# perftest_parameters.h, as written there (C string literals, PRIu64 between them, tabs as \t)
C_RESULT_LINE = r'"---------------------------------------------------------------------------------------\n"'
C_RESULT_FMT = r'" #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"'
C_RESULT_FMT_G = r'" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"'
C_REPORT_FMT = '" %-7lu    %-10" PRIu64 "       %-7.2lf            %-7.2lf\t\t     %-7.6lf"'
C_REPORT_FMT_EXT = '" %-7lu    %" PRIu64 "           %-7.6lf            %-7.6lf            %-7.6lf"'
C_RESULT_FMT_LAT = ('" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    '
                    't_stdev[usec]   99""%"" percentile[usec]   99.9""%"" percentile[usec] "')
C_REPORT_FMT_LAT = ('" %-7lu %" PRIu64 "          %-7.2f        %-7.2f      %-7.2f  \t       %-7.2f     \t%-7.2f'
                    '\t\t%-7.2f \t\t%-7.2f"')
# write_test_info_to_file's keys (host memory, RC, no rdma_cm) and REPORT_FMT_JSON's / REPORT_FMT_LAT_JSON's
TEST_INFO_KEYS = {"test", "Test with events", "Dual_port", "Device", "Number_of_qps", "Transport_type",
                  "Connection_type", "Using_SRQ", "PCIe_relax_order", "ibv_wr_API", "TX_depth", "Post_List",
                  "Recv_Post_List", "RX_depth", "CQ_Moderation", "Mtu", "Link_type", "GID_index", "Max_inline_data",
                  "Outstand_reads", "rdma_cm_QPs", "Use_ROCm_memory", "Use_MUSA_memory", "Data_ex_method"}
BW_RESULT_KEYS = ["MsgSize", "n_iterations", "BW_peak", "BW_average", "MsgRate"]
LAT_RESULT_KEYS = ["MsgSize", "n_iterations", "t_min", "t_max", "t_typical", "t_avg", "t_stdev", "percentile_99",
                   "percentile_99.9"]
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)  # a script's regex for a BW row


def c_format(literal: str) -> str:
    """A C format string as Python's %: adjacent literals joined, PRIu64 is "lu", C's length modifiers dropped."""
    joined = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', literal.replace("PRIu64", '"lu"')))
    text = joined.replace("\\n", "\n").replace("\\t", "\t")
    return re.sub(r"%(-?\d*(?:\.\d+)?)l?([uf])", lambda m: f"%{m[1]}{'d' if m[2] == 'u' else 'f'}", text)


def test_our_lines_are_perftests_format_strings():
    assert c_format(C_RESULT_LINE) == "-" * 87 + "\n"
    assert bw_header(False) == c_format(C_RESULT_FMT) and bw_header(True) == c_format(C_RESULT_FMT_G)
    for values in ((65536, 5000, 11200.34, 11199.81, 0.179197), (2, 23, 0.0, 1.5, 1.2), (8388608, 5, 0, 1e5, 0.01)):
        assert bw_row(*values, report_gbits=False) == c_format(C_REPORT_FMT) % values
        assert bw_row(*values, report_gbits=True) == c_format(C_REPORT_FMT) % values  # Gb/sec from 0.1 up
    slow = (4096, 100, 0.09, 0.0123456, 0.000002)
    assert bw_row(*slow, report_gbits=True) == c_format(C_REPORT_FMT_EXT) % slow  # six decimals below 0.1 Gb/sec
    assert bw_row(*slow, report_gbits=False) == c_format(C_REPORT_FMT) % slow
    from aiofabric.tools.perftest_format import RESULT_FMT_LAT
    assert RESULT_FMT_LAT == c_format(C_RESULT_FMT_LAT)
    latencies = [1.23, 45.6, 2.5, 3.75, 0.5, 40.0, 45.6]
    assert lat_row(2, 1000, latencies) == c_format(C_REPORT_FMT_LAT) % (2, 1000, *latencies)


def parse_bw(stdout: str) -> list[list[str]]:
    """A BW table read as scripts read it: the rows after the "#bytes" line, up to the dashes, split on spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("#bytes"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("---"):
            break
        rows.append(line.split())
    return rows


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiofabric", *argv], capture_output=True, text=True, timeout=120)


def test_a_bench_table_reads_as_perftests():
    process = run("bench", "write", "-n", "30", "-s", "4K", "-q", "2")
    assert process.returncode == 0, process.stderr
    rows = parse_bw(process.stdout)
    assert len(rows) == 1 and len(rows[0]) == 5, process.stdout
    size, iterations, peak, average, rate = rows[0]
    assert (size, iterations) == ("4096", "60")  # -n times -q
    assert float(peak) >= float(average) > 0 and float(rate) > 0
    assert [match[:2] for match in ROW.findall(process.stdout)] == [("4096", "60")]  # nothing else looks like a row
    lines = process.stdout.splitlines()
    assert lines[0] == "-" * 87 and lines[1] == "                    RDMA_Write BW Test"
    for line in (" Number of qps   : 2\t\tTransport type : IB", " TX depth        : 30", " CQ Moderation   : 30",
                 " Mtu             : 4096[B]", " Link type       : Ethernet", " Max inline data : 0[B]"):
        assert line in lines, process.stdout
    closing = lines.index(bw_header(False)) + 2
    assert lines[closing] == "-" * 87  # then aiofabric's own lines: none of them starts with a number
    assert all(not line.split()[0][0].isdigit() for line in lines[closing + 1:]), process.stdout
    assert "verified: yes" in process.stdout


def test_a_latency_table_reads_as_perftests_with_its_sorted_samples():
    process = run("lat", "write", "-n", "25", "-H", "-U")
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    headers = [i for i, line in enumerate(lines) if line == c_format(C_RESULT_FMT_LAT)]
    assert len(headers) == 2 and lines[headers[1] - 1] == "-" * 87  # perftest repeats its title after the samples
    titles = [i for i, line in enumerate(lines) if line == "#, usec"]
    unsorted = [float(line.split(", ")[1]) for line in lines[titles[0] + 1:titles[1]]]
    listed = [float(line.split(", ")[1]) for line in lines[titles[1] + 1:headers[1] - 1]]
    assert len(unsorted) == 25 and len(listed) == 23  # -H: sorted, without the two largest (LAT_MEASURE_TAIL)
    assert listed == sorted(listed) and [n for n, _ in (line.split(", ") for line in lines[titles[1] + 1:headers[1]
                                                                                          - 1])] == \
        [str(i) for i in range(1, 24)]
    row = lines[headers[1] + 1].split()
    assert len(row) == 9 and row[:2] == ["2", "25"] and float(row[2]) == pytest.approx(min(listed), abs=0.01)
    assert lines[headers[1] + 2] == "-" * 87 and " TX depth        : 1" in lines and \
        " Max inline data : 96[B]" in lines  # perftest's latency defaults on a NetXtreme device
    assert "latency histogram" not in process.stdout  # ours is --histogram


@pytest.mark.parametrize("tool,test,argv", [("bench", "write", ["-n", "20", "-s", "4K", "-b"]),
                                            ("bench", "read", ["-n", "20", "-s", "4K", "-x", "0"]),
                                            ("lat", "send", ["-n", "20"])])
def test_out_json_has_perftests_keys(tmp_path, tool, test, argv):
    file = tmp_path / "out.json"
    process = run(tool, test, *argv, "--out_json_file", str(file))
    assert process.returncode == 0, process.stderr
    report = json.loads(file.read_text())
    info, results = report["test_info"], report["results"]
    assert set(info) <= TEST_INFO_KEYS and info["Number_of_qps"] == 1 and info["Mtu"] == 4096
    assert list(results) == (BW_RESULT_KEYS if tool == "bench" else LAT_RESULT_KEYS)
    assert results["n_iterations"] == 20 and info["TX_depth"] == (20 if tool == "bench" else 1)
    if tool == "bench":
        assert info["test"] == ("RDMA_Write_Bidirectional_BW_Test" if test == "write" else "RDMA_Read_BW_Test")
        assert info["CQ_Moderation"] == 20 and results["BW_peak"] >= results["BW_average"] > 0
        assert info.get("Outstand_reads") == (16 if test == "read" else None) and \
            info.get("GID_index") == (0 if test == "read" else None)
    else:
        assert info["test"] == "Send_Latency_Test" and info["Max_inline_data"] == 96 and "CQ_Moderation" not in info


def test_the_peak_is_perftests_fastest_stretch():
    """print_report_bw's peak: the least (tcompleted[j] - tposted[i]) / (j - i + 1) over posts i and signaled
    completions j >= i; here in O(n log n), checked against perftest's every pair."""
    def perftests(posts, completions):
        return min((c - t) / (j - i + 1) for i, t in posts for j, c in completions if i <= j)

    for seed in range(300):
        rng = random.Random(seed)
        timeline, clock, in_flight = Timeline(), 0.0, []
        total, depth = rng.randint(1, 80), rng.randint(1, 12)
        chunk = rng.randint(1, depth)
        while timeline.completed < total:
            if timeline.posted < total and timeline.posted - timeline.completed < depth and rng.random() < 0.6:
                count = min(chunk, total - timeline.posted, depth - (timeline.posted - timeline.completed))
                clock += rng.random()
                timeline.post(count, clock)
                in_flight.append(count)
            elif in_flight:
                clock += rng.random() * 3
                timeline.complete(in_flight.pop(0), clock)
        assert timeline.fastest() == pytest.approx(perftests(timeline.posts, timeline.completions), abs=1e-9)
        assert timeline.fastest() <= timeline.span() / total + 1e-9  # the whole run is one stretch: peak >= average
    assert fastest([], []) == 0.0


def test_no_peak_where_perftest_measures_none():
    """BW peak 0 with -N, -D, --run_infinitely, and past perftest's 20000 iterations per QP."""
    assert BenchConfig(iters=20000).measures_peak and not BenchConfig(iters=20001).measures_peak
    assert not BenchConfig(no_peak=True).measures_peak and not BenchConfig(duration=1.0).measures_peak
    result = json.loads(run("bench", "write", "-n", "20", "-s", "4K", "-N", "--json").stdout.splitlines()[-1])
    assert result["ok"] and result["bw_peak_MiBps"] == 0 and result["bw_MiBps"] > 0


def config_of(*argv):
    parser = cli.build_parser()
    args = parser.parse_args(list(argv))
    args.typed = perftest_flags.typed_flags(parser, list(argv))
    args.check(args)
    return (BenchConfig if args.command == "bench" else LatConfig).from_args(args)


@pytest.mark.parametrize("argv,iters,tx_depth,cq_mod", [
    (["write"], 5000, 128, 1),  # DEF_ITERS_WB, DEF_TX_BW; CQ moderation off above 8 KiB
    (["read"], 1000, 128, 1), (["send"], 1000, 128, 1), (["atomic"], 1000, 128, 100),
    (["write", "-s", "8K"], 5000, 128, 100), (["write", "-s", "8193"], 5000, 128, 1),  # MSG_SIZE_CQ_MOD_LIMIT
    (["write", "-Q", "4"], 5000, 128, 4), (["write", "-e"], 5000, 128, 100), (["write", "-a"], 5000, 128, 100),
    (["write", "-n", "10"], 10, 10, 1), (["write", "-s", "64", "-n", "10"], 10, 10, 10),  # tx_depth <= iters
    (["write", "-s", "64", "-t", "16"], 5000, 16, 16), (["write", "-D", "2", "-s", "64"], 5000, 128, 100),
])
def test_bench_defaults_are_perftests(argv, iters, tx_depth, cq_mod):
    config = config_of("bench", *argv)
    assert (config.iters, config.tx_depth, config.chunk, config.inline_size) == (iters, tx_depth, cq_mod, 0)
    assert config.size == (8 if argv[0] == "atomic" else int(argv[argv.index("-s") + 1].replace("K", "")) *
                           (1024 if "K" in argv[argv.index("-s") + 1] else 1) if "-s" in argv else 65536)


@pytest.mark.parametrize("argv,inline", [(["write"], 96), (["send"], 96), (["read"], 0), (["atomic"], 0),
                                         (["write", "-I", "0"], 0), (["send", "-I", "16"], 16)])
def test_lat_defaults_are_perftests(argv, inline):
    config = config_of("lat", *argv)
    assert (config.iters, config.inline_size, config.sweep_seconds) == (1000, inline, None)
    assert config.size == (8 if argv[0] == "atomic" else 2)


def test_a_sweep_keeps_perftests_iterations_and_says_what_that_costs():
    """-a runs perftest's -n per size (5000 for write) and the banner says it takes minutes here; our own sweep
    flags without -n run about a second per size."""
    config = config_of("bench", "write", "-a")
    assert config.iters == 5000 and config.sweep_seconds is None
    assert " Note            : 78.1 GiB to move (5000 iterations of each size, as perftest): minutes on the " \
           "emulated NIC; -n runs fewer" in table_head(config).splitlines()
    assert "Note" not in table_head(config_of("bench", "write")) + table_head(config_of("bench", "write", "-a", "-n",
                                                                                         "10"))
    assert config_of("bench", "write", "--min-size", "1K").sweep_seconds == 1.0
    assert config_of("lat", "write", "-a").sweep_seconds is None
