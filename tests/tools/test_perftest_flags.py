"""perftest's command line on `aiofabric bench` / `lat`: aliases, refused flags, defaults and meanings (#iterations
of every QP, warm-up excluded), errors under the spelling typed, bounded sweeps, --output and --out_json."""
import functools
import json
import re
import subprocess
import sys

import pytest

from aiofabric.tools import cli, perftest_flags, runs
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.sweeps import sweep_iterations
from tests.support.results import without_metadata

BENCH_ALIASES = [  # (perftest's spelling, ours): each pair must parse to the same configuration
    (["-n", "77"], ["--iters", "77"]), (["-q", "3"], ["--qps", "3"]), (["--qp", "3"], ["--qps", "3"]),
    (["-t", "16"], ["--depth", "16"]), (["--tx-depth", "16"], ["--depth", "16"]), (["-m", "1024"], ["--mtu", "1024"]),
    (["-d", "sim:x"], ["--nic", "sim:x"]), (["--ib-dev", "sim:x"], ["--nic", "sim:x"]),
    (["-u", "9"], ["--timeout", "9"]), (["--qp-timeout", "9"], ["--timeout", "9"]),
    (["--report_gbits"], ["--report-gbits"]), (["-l", "4"], ["--post-list", "4"]), (["--post_list", "4"], ["-l", "4"]),
    (["-I", "64"], ["--inline-size", "64"]), (["--inline_size", "64"], ["--inline-size", "64"]),
    (["-Q", "8"], ["--cq-mod", "8"]), (["-x", "0"], ["--gid-index", "0"]), (["-D", "2"], ["--duration", "2"]),
    (["--run_infinitely"], ["--run-infinitely"]), (["-s", "4K"], ["--size", "4096"]), (["-e"], ["--events"]),
    (["--out_json_file", "f.json"], ["--json-file", "f.json"]), (["-o", "4"], ["--outs", "4"]),
    (["-b"], ["--bidirectional"]), (["-N"], ["--noPeak"]), (["-f", "0.5", "-D", "2"], ["--margin", "0.5", "-D", "2"]),
]


def parsed(*argv):
    parser = cli.build_parser()
    args = parser.parse_args(list(argv))
    args.typed = perftest_flags.typed_flags(parser, list(argv))
    args.check(args)
    return args


def config_of(*argv):
    """What a command line runs: the engine's configuration and the file the report goes to."""
    args = parsed(*argv)
    return (BenchConfig if args.command == "bench" else LatConfig).from_args(args), args.json_file


@pytest.mark.parametrize("theirs,ours", BENCH_ALIASES, ids=[" ".join(t) for t, _ in BENCH_ALIASES])
def test_every_bench_alias_parses_to_its_long_form(theirs, ours):
    test = "read" if "-o" in theirs else "send" if "-r" in theirs else "write"
    assert config_of("bench", test, *theirs) == config_of("bench", test, *ours)
    assert config_of("bench", test, *theirs) != config_of("bench", test)  # the flag changed something


@pytest.mark.parametrize("theirs,ours", [(["-n", "9"], ["--iters", "9"]), (["-H"], ["--report-histogram"]),
                                         (["--report-histogrm"], ["-H"]), (["-u", "3"], ["--timeout", "3"]),
                                         (["-d", "sim:y"], ["--nic", "sim:y"]), (["-U"], ["--report-unsorted"]),
                                         (["-I", "8"], ["--inline-size", "8"]), (["-m", "512"], ["--mtu", "512"])])
def test_every_lat_alias_parses_to_its_long_form(theirs, ours):
    assert config_of("lat", "write", *theirs) == config_of("lat", "write", *ours) != config_of("lat", "write")


def test_flags_perftest_accepts_and_ignores_here_change_nothing():
    assert config_of("bench", "write", "-F", "-i", "1", "-c", "RC", "--report-both") == config_of("bench", "write")


def usage(capsys, *argv):
    code = cli.main([*argv, "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 2 and result["ok"] is False and result["error"].startswith("usage: "), result
    return result["error"]


REFUSED = [spelling for flags, _, _ in perftest_flags.REFUSED for spelling in flags]


@pytest.mark.parametrize("flag", REFUSED)
def test_every_refused_perftest_flag_is_named(capsys, flag):
    error = usage(capsys, "bench", "write", flag)
    assert error.startswith(f"usage: {flag}: not supported by aiofabric bench: ")


def test_perftest_readme_command_lines_run_or_name_what_is_refused(capsys):
    # from perftest's README: "./ib_write_bw -d ib_dev --use_cuda=<gpu index> -a", "./ib_write_bw --pin_cores=5 -d
    # mlx5_0": refused naming the first flag aiofabric does not do
    assert "--use_cuda: not supported" in usage(capsys, "bench", "write", "-d", "sim", "--use_cuda=0", "-a")
    assert "--pin_cores: not supported" in usage(capsys, "bench", "write", "--pin_cores=5", "-d", "sim")
    assert "-R: not supported" in usage(capsys, "lat", "write", "-R")
    assert "-q: not supported by aiofabric lat" in usage(capsys, "lat", "write", "-q", "2")
    assert "-c/--connection: UD: aiofabric runs RC" in usage(capsys, "bench", "send", "-c", "UD")
    assert "-i/--ib-port: 2: a BNXT PCI function has one RoCE port" in usage(capsys, "bench", "write", "-i", "2")
    # an unknown flag: named under bench's usage, not the top-level one
    assert usage(capsys, "bench", "write", "--frobnicate") == "usage: unrecognized arguments: --frobnicate"
    code = cli.main(["bench", "write", "--frobnicate"])
    assert code == 2 and capsys.readouterr().err.startswith("usage: aiofabric bench")


@pytest.mark.parametrize("argv,message", [
    (["bench", "write", "-q", "0"], "-q 0: must be at least 1"),
    (["bench", "write", "--qps", "0"], "--qps 0: must be at least 1"),
    (["bench", "write", "-t", "0"], "-t 0: must be at least 1"),
    (["bench", "write", "--tx-depth", "8", "-l", "9"], "-l 9: must be in [1, --tx-depth 8]"),
    (["bench", "write", "-u", "40"], "-u 40: must be in [0, 31]"),
    (["bench", "write", "-Q", "200"], "-Q 200: must be in [1, --tx-depth 128]"),
    (["bench", "read", "-I", "8"], "-I 8: inline data goes with write and send"),
    (["bench", "write", "-o", "2"], "-o 2: applies to read and atomic only"),
    (["lat", "write", "-d", "0000:41:00.0", "--ip", "10.0.0.1", "--loss", "0.1"],
     "--loss 0.1: --loss applies to the emulated wire only, not to the PCI NIC 0000:41:00.0"),
    (["bench", "send", "-r", "4"], "-r 4: sizes the send test's receive queue: at least --tx-depth 128"),
    (["bench", "send", "-r", "4", "-n", "8"], "-r 4: sizes the send test's receive queue: at least --tx-depth 8"),
    (["bench", "write", "-f", "1"], "-f 1.0: is the warm-up of a -D run"),
    (["lat", "write", "-n", "0"], "-n 0: must be an integer of at least 1"),
    (["bench", "write", "--output", "latency"], "--output latency: bench reports bandwidth or message_rate"),
    (["bench", "write", "-A", "CMP_AND_SWAP"], "-A/--atomic_type CMP_AND_SWAP: goes with the atomic test"),
])
def test_out_of_range_values_exit_2_under_the_spelling_typed(capsys, argv, message):
    assert message in usage(capsys, *argv)


def test_limits_the_nic_sets_are_usage_errors_under_the_spelling_typed(capsys):
    """What only the booted NIC knows (max_qp 1026, max_inline_data 96 on the emulated NIC) still exits 2."""
    assert usage(capsys, "bench", "write", "-q", "100000", "-n", "2").startswith("usage: -q 100000: 100000 QPs on a NIC")
    assert usage(capsys, "bench", "write", "-q", "600", "-b", "-n", "2").startswith(
        "usage: -q 600: 1200 QPs on a NIC")
    assert "--inline-size 200: bytes of inline data exceed what" in usage(capsys, "bench", "write", "--inline-size",
                                                                         "200", "-n", "2")
    assert "-x 3: " in usage(capsys, "bench", "write", "-x", "3", "-n", "2")


def test_lat_takes_perform_warm_up_and_the_nics_gid_index_and_refuses_duration_saying_why(capsys):
    assert config_of("lat", "write", "--perform_warm_up") == config_of("lat", "write")  # lat always warms up
    assert usage(capsys, "lat", "write", "-D", "2") == (
        "usage: -D: not supported by aiofabric lat: lat runs -n iterations: both halves of its ping-pong, the "
        "server's on another host too, are started with their count (bench runs for a duration)")
    assert usage(capsys, "bench", "write", "--perform_warm_up") == (
        "usage: --perform_warm_up: not supported by aiofabric bench: -n runs are measured whole (and verified "
        "whole); with -D the first -f seconds are the warm-up")
    process = bench("lat", "write", "-x", "0", "-n", "10", "--perform_warm_up")
    assert process.returncode == 0 and " GID index       : 0" in process.stdout.splitlines(), process.stderr
    error = usage(capsys, "lat", "write", "-x", "1", "-n", "10")
    assert re.fullmatch(r"usage: -x 1: sim:\S+'s GID ::ffff:127\.0\.0\.\d+ is at index 0", error), error


def test_device_names_resolve_through_sysfs(tmp_path, monkeypatch):
    function = tmp_path / "devices" / "0000:41:00.1"
    function.mkdir(parents=True)
    for cls, name in (("net", "enp65s0f1np1"), ("infiniband", "bnxt_re1")):
        (tmp_path / cls / name).mkdir(parents=True)
        (tmp_path / cls / name / "device").symlink_to(function)
    monkeypatch.setattr(perftest_flags, "SYSFS_CLASSES", (str(tmp_path / "net"), str(tmp_path / "infiniband")))
    assert perftest_flags.device("enp65s0f1np1") == perftest_flags.device("bnxt_re1") == "0000:41:00.1"
    assert perftest_flags.device("0000:41:00.0") == "0000:41:00.0" and perftest_flags.device("sim:a") == "sim:a"
    (tmp_path / "net" / "lo").mkdir()  # a virtual interface has no PCI function behind it
    for name in ("lo", "eth9", "../net/enp65s0f1np1"):
        with pytest.raises(Exception, match="network interface or RDMA device"):
            perftest_flags.device(name)


def bench(*argv, timeout=120):
    process = subprocess.run([sys.executable, "-m", "aiofabric.tools.cli", *argv], capture_output=True, text=True,
                             timeout=timeout)
    return process


def json_of(process):
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_iterations_are_every_qps_as_perftest_prints_them():
    """perftest's print_report_bw: #iterations is -n times the QPs (num_of_calculated_iters *= num_of_qps), and the
    averages are of all of them; -b: each side reports its own direction's."""
    process = bench("bench", "write", "-q", "8", "-n", "10", "-s", "64", "--json")
    result = json_of(process)
    assert result["ok"] and result["iterations"] == 80 == result["ops"] == result["measured_ops"], process.stderr
    assert result["msg_rate"] == pytest.approx(80 / result["seconds"])
    assert result["bw_MiBps"] == pytest.approx(80 * 64 / result["seconds"] / 2**20)
    process = bench("bench", "write", "-b", "-n", "100", "-s", "64", "--json")
    result = json_of(process)
    assert result["ok"] and result["iterations"] == 100 and result["ops"] == 200
    process = bench("bench", "write", "-q", "4", "-n", "25", "-s", "64")
    row = process.stdout.split("#iterations")[1].splitlines()[1].split()
    assert process.returncode == 0 and row[:2] == ["64", "100"], process.stdout


def test_the_warm_up_of_a_duration_run_is_not_counted():
    """-D: #iterations counts every QP's completions after the warm-up (perftest's duration mode), and no peak."""
    result = json_of(bench("bench", "write", "-D", "1.5", "-f", "0.5", "-s", "64", "-q", "2", "--json"))
    assert result["ok"] and result["warmup_seconds"] == 0.5 and result["bw_peak_MiBps"] == 0
    assert result["iterations"] == result["measured_ops"] < result["ops"]  # what ran in the warm-up is left out
    assert abs(result["seconds"] - 1.5) < 0.5


def test_output_prints_only_the_number_and_out_json_has_perftests_keys(tmp_path):
    process = subprocess.run([sys.executable, "-m", "aiofabric.tools.cli", "bench", "write", "-n", "50", "-s", "4K",
                              "-q", "2", "--output", "bandwidth", "--report_gbits", "--out_json"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert process.returncode == 0 and len(process.stdout.split()) == 1, process.stdout
    assert len(process.stdout.split(".")[1].strip()) == 6  # perftest's "%lf"
    report = json.loads((tmp_path / perftest_flags.DEFAULT_JSON_FILE).read_text())
    assert report["ok"] and report["test_info"]["test"] == "RDMA_Write_BW_Test"
    assert report["results"] == {"bw_avg": pytest.approx(float(process.stdout), abs=1e-6)}  # as perftest writes it
    assert report["results"]["bw_avg"] == pytest.approx(report["bw_Gbps"])  # the same number, in Gb/sec
    process = subprocess.run([sys.executable, "-m", "aiofabric.tools.cli", "bench", "write", "-n", "50", "-s", "4K",
                              "-q", "2", "--out_json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    report = json.loads((tmp_path / perftest_flags.DEFAULT_JSON_FILE).read_text())
    assert process.returncode == 0 and report["results"]["MsgSize"] == 4096
    assert report["results"]["n_iterations"] == 100 == report["iterations"]  # -n x -q
    assert report["test_info"]["Number_of_qps"] == 2 and report["test_info"]["TX_depth"] == 50
    assert report["test_info"]["CQ_Moderation"] == 50 == report["cq_mod"]  # 100, at most the depth
    rate = bench("bench", "write", "-n", "50", "-s", "64", "--output", "message_rate")
    assert rate.returncode == 0 and 0 < float(rate.stdout) < 100  # Mpps


def test_events_inline_cq_mod_and_outs_run_verified():
    for argv in (["write", "-e", "-I", "64", "-s", "64"], ["send", "-I", "96", "-s", "96", "-r", "64"],
                 ["write", "-Q", "4", "-t", "16"], ["read", "-o", "4", "-s", "8K"]):
        process = bench("bench", *argv, "-n", "40", "--json")
        result = json_of(process)
        assert result["ok"] and result["verified"], (argv, process.stdout, process.stderr)
    assert result["cq_mod"] == 40 and json_of(bench("bench", "write", "-Q", "4", "-n", "8", "--json"))["cq_mod"] == 4


def test_a_default_sweep_runs_about_a_second_per_size():
    process = bench("bench", "write", "-a", "--min-size", "1K", "--max-size", "8K", "--json", timeout=180)
    result = json_of(process)
    assert result["ok"] and [row["size"] for row in result["rows"]] == [1024, 2048, 4096, 8192], process.stderr
    # each size about a second, whatever the emulator's speed: its iterations come from the sizes measured before
    # it, so a machine whose load changes meanwhile (CI beside a CPU hog) can make one size run short; the median
    # holds, and no size runs for mere milliseconds or for many seconds
    seconds = sorted(row["seconds"] for row in result["rows"])
    assert 0.25 < (seconds[1] + seconds[2]) / 2 < 4 and 0.03 < seconds[0] and seconds[-1] < 8, result["rows"]
    assert len({row["iterations"] for row in result["rows"]}) > 1  # chosen per size
    fixed = json_of(bench("bench", "write", "-a", "--min-size", "1K", "--max-size", "2K", "-n", "7", "--json"))
    assert [row["iterations"] for row in fixed["rows"]] == [7, 7]  # -n overrides


def test_sweep_iterations_follow_the_measured_cost():
    assert sweep_iterations([(1024, 1e-4)], 2048, 1.0) == 5000  # one point: cost per byte alone
    assert sweep_iterations([(1024, 1e-4), (2048, 1e-4)], 4096, 1.0) == 10000  # flat: a fixed cost
    assert sweep_iterations([(1, 1.0)], 1 << 20, 1.0) == 5  # at least perftest's minimum


def test_lat_unsorted_cycles_and_sweep():
    process = bench("lat", "write", "-n", "20", "-U", "-C")
    lines = process.stdout.splitlines()
    first = lines.index("#, cycles")  # after perftest's banner and the table's title, as perftest prints them
    assert process.returncode == 0 and lines[first + 1].startswith("1, ") and first > 10, process.stdout
    assert len([line for line in lines if line[:1].isdigit()]) == 20 and "in CPU cycles at" in process.stdout
    result = json_of(bench("lat", "send", "-a", "--json", "-n", "10", "--warmup", "2"))
    assert result["ok"] and len(result["rows"]) == 23 and all(row["iterations"] == 10 for row in result["rows"])
    process = bench("lat", "read", "-n", "30", "--output", "latency")
    assert process.returncode == 0 and float(process.stdout) > 0


# -- atomics: perftest's ib_atomic_bw / ib_atomic_lat -----------------------------------------------------------
@pytest.mark.parametrize("argv", [["-A", "FETCH_AND_ADD"], ["-A", "CMP_AND_SWAP", "-q", "2"],
                                  ["--loss", "0.03", "--dup", "0.03", "-q", "2", "-t", "8"],
                                  ["-A", "CMP_AND_SWAP", "--loss", "0.03", "--dup", "0.03", "-o", "4"]],
                         ids=["fetch-add", "cmp-swap", "fa-lossy", "cas-lossy"])
def test_bench_atomic_runs_verified(argv):
    process = bench("bench", "atomic", "-n", "300", *argv, "--json")
    result = json_of(process)
    assert process.returncode == 0 and result["ok"] and result["verified"], process.stdout + process.stderr[-2000:]
    assert result["size"] == 8 and result["iterations"] == 300 * result["qps"] and result["bytes"] == 8 * result["ops"]
    assert result["verification"] == "the counter and every atomic's original value and the NIC's placement counts"
    if "--loss" in argv:  # the wire lost and duplicated packets, and still every atomic ran exactly once
        assert result["retransmits"] > 0 and result["dropped"] > 0


def test_lat_atomic_runs_verified_and_the_table_names_the_operation():
    for kind in ("FETCH_AND_ADD", "CMP_AND_SWAP"):
        result = json_of(bench("lat", "atomic", "-A", kind, "-n", "60", "--json"))
        assert result["ok"] and result["verified"] and result["latency"] == "ATOMIC completion", result
    process = bench("bench", "atomic", "-n", "20")
    assert "Atomic FETCH_AND_ADD BW Test" in process.stdout and "Outstand reads  : 16" in process.stdout


@pytest.mark.parametrize("argv,message", [
    (["bench", "atomic", "-s", "64"], "-s 64: an atomic moves 8 bytes"),
    (["bench", "atomic", "-l", "4"], "-l 4: atomics are posted one work request per call"),
    (["bench", "atomic", "-a"], "--size 2: an atomic moves 8 bytes"),
    (["lat", "atomic", "-s", "16"], "-s 16: an atomic moves 8 bytes"),
    (["bench", "atomic", "-A", "SWAP"], "argument -A/--atomic_type: invalid choice: 'SWAP'"),
    (["bench", "atomic", "-I", "8"], "-I 8: inline data goes with write and send"),
])
def test_atomic_refusals_name_the_flag(capsys, argv, message):
    assert message in usage(capsys, *argv)


def test_the_atomic_check_sees_a_wrong_original_or_counter():
    """The verifier itself, on results tampered one way at a time (a pure check: no NIC)."""
    import asyncio
    from types import SimpleNamespace

    from aiofabric.tools.bench_verify import atomic_results as _atomic_results

    def flow(originals, counter):
        source = bytearray(b"".join(v.to_bytes(8, "little") for v in originals))
        return SimpleNamespace(done=len(originals), source=SimpleNamespace(view=memoryview(source)), remote=None,
                               target=SimpleNamespace(view=memoryview(bytearray(counter.to_bytes(8, "little")))),
                               client=SimpleNamespace(qpn=7))
    config = BenchConfig(test="atomic", size=8, iters=4)
    check = lambda f: asyncio.run(_atomic_results(config, f))  # noqa: E731
    assert check(flow([0, 1, 2, 3], 4)) is None
    assert "atomic 2 found the counter at 1" in check(flow([0, 1, 1, 3], 4))
    assert "the counter is 5 after 4 atomics" in check(flow([0, 1, 2, 3], 5))


# every option perftest's parser knows (perftest_parameters.c: long_options and usage), short and long
PERFTEST_FLAGS = """
-p --port -d --ib-dev -i --ib-port -m --mtu -s --size -n --iters -t --tx-depth -u --qp-timeout -S --sl -x --gid-index
-a --all -F --CPU-freq -c --connection -q --qp -e --events -X --vector -I --inline_size -o --outs -g --mcg
-z --comm_rdma_cm -R --rdma_cm -T --tos -L --hop_limit -h --help -M --MGID -r --rx-depth -b --bidirectional
-Q --cq-mod -N --noPeak -V --version -C --report-cycles -H --report-histogrm -U --report-unsorted -A --atomic_type
-O --dualport -l --post_list -D --duration -f --margin -B --source_mac -E --dest_mac -J --dest_ip -j --source_ip
-K --dest_port -k --source_port -Y --ethertype -w --limit_bw -y --limit_msgrate -Z --server -P --client -v --mac_fwd
-G --use_rss -W --report-counters --force-link --remote_mac --local_mac --remote_ip --local_ip --remote_port
--local_port --run_infinitely --report_gbits --use-srq --no_lock --use-null-mr --report-both --reversed --pkey_index
--tcp --burst_size --typical_pkt_size --rate_limit --rate_limit_type --rate_units --output --cpu_util --out_json
--out_json_file --latency_gap --flow_label --retry_count --dont_xchg_versions --payload_file_path --use_cuda
--use_cuda_bus_id --use_cuda_dmabuf --use_cuda_pcie_mapping --use_data_direct --cuda_mem_type --use_musa
--use_musa_bus_id --use_musa_dmabuf --use_musa_pcie_mapping --use_rocm --use_rocm_dmabuf --use_neuron
--use_neuron_dmabuf --use_hl --use_mlu --use_mlu_dmabuf --use_opencl --opencl_platform_id --use_ib_dm_dmabuf
--gpu_touch --mmap --mmap-offset --ipv6 --ipv6-addr --raw_ipv6 --report-per-port --odp --use_hugepages
--use_old_post_send --promiscuous --sniffer --raw_mcast --mr_per_qp --dlid --tclass --wait_destroy --flows
--flows_burst --reply_every --perform_warm_up --vlan_en --vlan_pcp --recv_post_list --aes_xts --encrypt_on_tx
--sig_before --aes_block_size --kek_path --credentials_path --data_enc_keys_number --data_enc_key_app_path
--log_dci_streams --log_active_dci_streams --disable_pcie_relaxed --use_ooo --congest_type --cqe_poll
--data_validation --data_validation_debug --disable_dynamic_polling --tph_mem --cpu_id --ph --pin_cores --numa_node
--disable_numa --bind_source_ip --connectionless --sig_offload --no_enhanced_reorder
""".split()


@pytest.mark.parametrize("command", ["bench", "lat"])
def test_every_perftest_flag_is_an_alias_or_refused_by_name(command):
    """None falls through to argparse's 'unrecognized arguments': each is ours, or refused with a reason."""
    known = cli.build_parser().commands[command]._option_string_actions
    assert [flag for flag in PERFTEST_FLAGS if flag not in known] == []


def test_connect_sizes_take_suffixes_like_the_rest():
    assert parsed("connect", "somehost", "--size", "64K").size == 65536


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_events_make_the_pollers_sleep_on_the_interrupt_without_polling_first():
    from aiofabric.tools.perftest import open_bench_nics, run_bench
    config = BenchConfig(test="write", size=64, iters=300, depth=4, events=True)
    async with open_bench_nics(config) as nics:
        result = await run_bench(config, nics)
        stats = nics[0].poller.stats
    assert result["verified"] and result["events"] and nics[0].poller.spin == 0
    # every completion came by interrupt, and the poller polled a few times per wake-up, not spinning in between
    # (polling first, as without -e, takes ~20 polls per wake-up here)
    assert stats["spins_found"] == 0 and 0 < stats["polls"] < 8 * stats["wakeups"], stats


def test_the_nic_limits_count_what_one_nic_holds():
    """Each NIC of a pair holds one QP per flow (the client's or the server's): 1024 QPs fit max_qp 1216, 1217 do
    not, and -b doubles the flows. A pure check against the caps the emulated NIC reports."""
    from types import SimpleNamespace

    from aiofabric.errors import BadOption
    nic = SimpleNamespace(device=SimpleNamespace(caps={"max_qp": 1216, "max_qp_wr": 65535, "max_cqe": 4194303,
                                                       "max_qp_rd_atom": 16, "max_inline_data": 96}, gid_index=0),
                          pci=SimpleNamespace(address="sim:x"), ip="127.0.0.5")
    BenchConfig(qps=1024).check_caps(nic)
    BenchConfig(qps=2048, nics=4).check_caps(nic)  # spread over two pairs
    for config in (BenchConfig(qps=1217), BenchConfig(qps=700, bidirectional=True)):
        with pytest.raises(BadOption, match="QPs on a NIC"):
            config.check_caps(nic)
    with pytest.raises(BadOption, match="-x|gid"):
        BenchConfig(gid_index=1).check_caps(nic)


def test_the_atomic_check_sees_the_first_original_never_written():
    """The local slots start as what no atomic returns (all ones), so atomic 0's original (0) must be written back."""
    import asyncio
    from types import SimpleNamespace

    from aiofabric.tools.bench_verify import atomic_results as _atomic_results
    from aiofabric.tools.options import NO_ORIGINAL
    source = bytearray(NO_ORIGINAL + b"".join(v.to_bytes(8, "little") for v in (1, 2, 3)))
    flow = SimpleNamespace(done=4, source=SimpleNamespace(view=memoryview(source)), remote=None, client=SimpleNamespace(qpn=7),
                           target=SimpleNamespace(view=memoryview(bytearray((4).to_bytes(8, "little")))))
    assert "atomic 0 found the counter at 18446744073709551615" in asyncio.run(
        _atomic_results(BenchConfig(test="atomic", size=8, iters=4), flow))


def test_version_is_json_with_json(capsys):
    assert cli.main(["lat", "write", "-V", "--json"]) == 0
    from aiofabric.version import __version__
    line = json.loads(capsys.readouterr().out)  # the metadata alone: no command ran
    assert (line["ok"], line["aiofabric_version"], line["command"], without_metadata(line)) == (
        True, __version__, None, {"ok": True})
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("aiofabric ")


@pytest.mark.parametrize("argv,named", [(["--output", "latency"], "--output"), (["--out_json"], "--out_json"),
                                        (["--out_json_file", "x.json"], "--out_json")])
def test_what_only_a_client_does_is_refused_on_a_server(capsys, argv, named):
    for command in ("bench", "lat"):
        flags = argv if command == "lat" or argv[0] != "--output" else ["--output", "bandwidth"]
        assert f"{named}: the client's options" in usage(capsys, command, "write", "--server", *flags)


def test_a_hostile_report_cannot_stretch_the_servers_histogram():
    from aiofabric.tools.lat_report import format_histogram
    assert max(len(line) for line in format_histogram([[1.0, 3], [2.0, 10 ** 9]]).splitlines()) < 120
    for rows in ([[1, -1], [2, -2000000]], [[1, 1.5]], [["x", 1]], [[1, float("inf")]], [[1, True]]):
        with pytest.raises(ValueError, match="histogram: a row must be"):
            format_histogram(rows)


def test_a_pci_nic_gets_no_emulator_option_unless_one_was_asked():
    """The collectives pass these to open_nic, which refuses any option for a PCI NIC: faults that are off (the
    defaults) are not options asked for."""
    from aiofabric.tools.options import WireOptions
    assert WireOptions().nic_options() == {}
    assert WireOptions(loss=0.1, seed=3).nic_options() == {"loss": 0.1, "seed": 3}
    assert WireOptions(pcap="x.pcap").nic_options() == {"pcap": "x.pcap"}


@pytest.mark.parametrize("tool", ["bench", "lat"])
def test_atomic_on_a_nic_whose_pcie_path_lacks_atomicops_exits_1_naming_the_port(tool, monkeypatch, capsys):
    """The NICs boot (it is the NIC, not the command line, that cannot): the run stops before any QP, with exit 1
    and why in one line."""
    monkeypatch.setattr(runs, "open_nic", functools.partial(runs.open_nic, pcie_path="no-completer"))
    code = cli.main([tool, "atomic", "-n", "10", "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 1 and result["ok"] is False, result
    assert re.fullmatch(r"UnsupportedError: the atomic test on sim:\S+: this NIC offers no atomics \(Linux's bnxt_re "
                        r"reports IB_ATOMIC_NONE\): root port 0000:00:01.0 does not complete 32-bit PCIe AtomicOps "
                        r"\(its DEVCAP2 0x0 lacks 0x80\)", result["error"]), result["error"]
