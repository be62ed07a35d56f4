"""perftest's command line on `aiofabric bench` and `aiofabric lat` (docs/command-line.md).

Each perftest flag bench or lat does is an alias of ours (`-q/--qp/--qps`), listed in perftest's --help order; each one
they do not do is refused naming the flag and why (`REFUSED`), never ignored. `typed_flags` finds the spelling a user
typed, so an out-of-range value (errors.BadOption) is reported under it: "-q 100000: ...", not "--qps ...".
"""
from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any, Sequence

from .arguments import integer, seconds_or_zero, size
from .options import ATOMIC_TYPES, MTUS
from .perftest_defaults import (DEF_CQ_MOD, DEF_ITERS, DEF_SIZE_BW, DEF_SIZE_LAT, DEF_TX_BW, MSG_SIZE_CQ_MOD_LIMIT,
                                NETXTREME_LAT_INLINE)
from ..errors import BadOption
from ..verbs import PCI_ADDRESS
from ..version import __version__

CONNECTIONS = ("RC", "XRC", "UC", "UD", "DC", "SRD")  # perftest's -c choices; aiofabric runs RC
BENCH_OUTPUTS, LAT_OUTPUTS = ("bandwidth", "message_rate"), ("latency",)  # perftest's --output, by tool
OUTPUTS = BENCH_OUTPUTS + LAT_OUTPUTS
DEFAULT_JSON_FILE = "perftest_out.json"  # perftest's --out_json file when --out_json_file does not name one
SYSFS_CLASSES = ("/sys/class/net", "/sys/class/infiniband")  # -d NAME: a network interface or an RDMA device
# how a --server names the parameters its clients must share, in its errors ("start both with the same ...")
PARAMETER_FLAGS = {"size": "-s", "sizes": "-a (sizes)", "atomic_type": "-A", "bidirectional": "-b", "duration": "-D",
                   "margin": "-f", "mtu": "-m", "iters": "-n", "qps": "-q", "depth": "-t",
                   "run_infinitely": "--run_infinitely"}

_UD_ONLY = "multicast runs on UD QPs; aiofabric runs RC"
_RDMA_CM = "aiofabric connects QPs through its own parameter exchange, not rdma_cm"
_ACCELERATOR = "buffers are host memory (registered from the NIC's DMA arena); accelerator memory is not supported"
_VENDOR = "a feature of other vendors' NICs, not of BNXT"
_RAW = "an option of perftest's raw_ethernet_* tests; aiofabric runs RoCE (its server mode is --server)"
# perftest flags bench and lat refuse: (spellings, takes a value, why)
REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("-g", "--mcg"), False, _UD_ONLY),
    (("-M", "--MGID"), True, _UD_ONLY),
    (("--connectionless",), False, _UD_ONLY),
    (("-O", "--dualport"), False, "a BNXT PCI function drives one RoCE port: run one test per function"),
    (("--report-per-port",), False, "a BNXT PCI function drives one RoCE port: run one test per function"),
    (("-R", "--rdma_cm"), False, _RDMA_CM),
    (("-z", "--comm_rdma_cm"), False, _RDMA_CM),
    (("-T", "--tos"), True, "it sets the ToS of rdma_cm QPs (-R): " + _RDMA_CM),
    (("--retry_count",), True, "it sets rdma_cm's retry count (-R): " + _RDMA_CM),
    (("-S", "--sl"), True, "RoCEv2 packets carry no service level; the QPs use the default traffic class"),
    (("--tclass",), True, "the QPs use the default traffic class"),
    (("--flow_label",), True, "the QPs send flow label 0"),
    (("-L", "--hop_limit"), True, "the QPs send the driver's fixed hop limit"),
    (("--pkey_index",), True, "RoCE QPs use P_Key index 0"),
    (("-X", "--vector"), True, "a NIC has one notification queue: there is no completion vector to choose"),
    (("-w", "--limit_bw"), True, "no pass/fail limits: `aiofabric compare BASE.json RUN.json` judges a --json "
                                 "result against a saved one, or read its bw_MiBps in a script"),
    (("-y", "--limit_msgrate"), True, "no pass/fail limits: `aiofabric compare BASE.json RUN.json` judges a --json "
                                      "result against a saved one, or read its msg_rate in a script"),
    (("-W", "--report-counters"), True, "sysfs counters are not read; the report's packet, retransmit and drop "
                                         "counts come from the emulated NIC"),
    (("--cpu_util",), False, "CPU utilisation is not sampled; the report's driver_cpu_us_per_op is the driver's CPU"),
    (("--reversed",), False, "the server side never sends: swap the hosts instead"),
    (("--use-srq",), False, "shared receive queues are not implemented"),
    (("--recv_post_list",), True, "receives are posted one per send"),
    (("--odp",), False, "on-demand paging is not implemented: every buffer is registered"),
    (("--use_hugepages",), False, "buffers come from the NIC's DMA arena"),
    (("--use-null-mr",), False, "every buffer is a registered memory region"),
    (("--mmap", "--mmap-offset"), True, "buffers come from the NIC's DMA arena"),
    (("--payload_file_path",), True, "payloads are seeded random bytes, so that every message can be verified"),
    (("--dont_xchg_versions",), False, "the two sides always exchange and compare their parameters"),
    (("--use_old_post_send",), False, "there is one post path"),
    (("--ipv6", "--ipv6-addr"), False, "GIDs are IPv4-mapped (::ffff:a.b.c.d)"),
    (("--bind_source_ip",), True, "use --ip: the address that reaches the server"),
    (("--latency_gap",), True, "the latency loop never waits between iterations"),
    (("--wait_destroy",), True, "resources are destroyed when the test ends"),
    (("--no_lock", "--no_enhanced_reorder", "--disable_pcie_relaxed", "--force-link", "--dlid", "--cqe_poll",
      "--disable_dynamic_polling", "--tph_mem", "--cpu_id", "--ph", "--congest_type", "--pin_cores", "--numa_node",
      "--disable_numa", "--data_validation", "--data_validation_debug"), True,
     "not implemented (every message is verified anyway: see 'verification' in the report)"),
    (("--burst_size", "--typical_pkt_size", "--rate_limit", "--rate_limit_type", "--rate_units"), True,
     "the rate limiter is not implemented"),
    (("--use_cuda", "--use_cuda_bus_id", "--use_cuda_dmabuf", "--use_cuda_pcie_mapping", "--use_data_direct",
      "--cuda_mem_type", "--use_musa", "--use_musa_bus_id", "--use_musa_dmabuf", "--use_musa_pcie_mapping",
      "--use_rocm", "--use_rocm_dmabuf", "--use_neuron", "--use_neuron_dmabuf", "--use_hl", "--use_mlu",
      "--use_mlu_dmabuf", "--use_opencl", "--opencl_platform_id", "--use_ib_dm_dmabuf", "--gpu_touch"), True,
     _ACCELERATOR),
    (("-B", "--source_mac", "-E", "--dest_mac", "-J", "--dest_ip", "-j", "--source_ip", "-K", "--dest_port", "-k",
      "--source_port", "-Y", "--ethertype", "--remote_mac", "--local_mac", "--remote_ip", "--local_ip",
      "--remote_port", "--local_port", "--flows", "--flows_burst", "--reply_every", "--vlan_pcp"), True, _RAW),
    (("-Z", "-P", "--client", "-v", "--mac_fwd", "-G", "--use_rss", "--tcp", "--promiscuous", "--sniffer",
      "--raw_mcast", "--raw_ipv6", "--vlan_en", "--use_ooo"), False, _RAW),
    (("--aes_xts", "--encrypt_on_tx", "--sig_before", "--aes_block_size", "--kek_path", "--credentials_path",
      "--data_enc_keys_number", "--data_enc_key_app_path", "--sig_offload", "--log_dci_streams",
      "--log_active_dci_streams"), True, _VENDOR),
)
# perftest's latency flags bench refuses (lat does them), and its flags for bandwidth tests bench does not do
BENCH_REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("-C", "--report-cycles", "-H", "--report-histogrm", "--report-histogram", "-U", "--report-unsorted"), False,
     "a latency report option: use aiofabric lat"),
    (("--perform_warm_up",), False, "-n runs are measured whole (and verified whole); with -D the first -f seconds "
                                    "are the warm-up"),
)
# perftest flags lat refuses (bench does them)
LAT_REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("-D", "--duration"), True, "lat runs -n iterations: both halves of its ping-pong, the server's on another "
                                 "host too, are started with their count (bench runs for a duration)"),
    (("-q", "--qp"), True, "lat runs one QP pair, as ib_*_lat"),
    (("-t", "--tx-depth"), True, "lat keeps one message in flight, as ib_*_lat"),
    (("-l", "--post_list"), True, "lat posts one message at a time; bench -l posts lists"),
    (("-Q", "--cq-mod"), True, "lat signals one send in 16 (its completions stay out of the timed path)"),
    (("-b", "--bidirectional"), False, "a ping-pong is both directions already"),
    (("-N", "--noPeak"), False, "lat reports no peak bandwidth"),
    (("-f", "--margin"), True, "lat runs -n iterations; its warm-up is --warmup"),
    (("--run_infinitely", "--run-infinitely"), False, "lat runs -n iterations"),
    (("--report_gbits", "--report-gbits", "--report-both"), False, "lat reports no bandwidth"),
    (("-r", "--rx-depth"), True, "lat posts its receives ahead itself (16)"),
)


class ShowVersion(Exception):
    """-V/--version was given: the command line prints the version (as JSON with --json) and exits 0."""


class VersionAction(argparse.Action):
    """argparse's version action, but leaving the printing to the command line, which knows about --json."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise ShowVersion(__version__)


class _Refused(argparse.Action):
    """A perftest flag aiofabric does not do: a usage error naming it (a value after it, if any, is taken along)."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: not supported by aiofabric {parser.prog.split()[-1]}: {self.reason}")


def _refuse(parser: argparse.ArgumentParser, table: Sequence[tuple[tuple[str, ...], bool, str]]) -> list[str]:
    spellings: list[str] = []
    for flags, takes_value, reason in table:
        for flag in flags:
            parser.add_argument(flag, action=_Refused, reason=reason, nargs="?" if takes_value else 0,
                                dest=f"refused_{flag.lstrip('-')}", help=argparse.SUPPRESS)
        spellings.extend(flags)
    return spellings


def device(text: str) -> str:
    """-d/--ib-dev/--nic: 'sim', 'sim:NAME', a PCI address, or a network interface / RDMA device name (eth0,
    bnxt_re0) resolved through sysfs to its PCI function."""
    if PCI_ADDRESS.fullmatch(text):
        return text.lower()
    if text == "sim" or text.startswith("sim:"):
        return text
    if "/" not in text and text not in ("", ".", ".."):
        for root in SYSFS_CLASSES:
            function = os.path.basename(os.path.realpath(os.path.join(root, text, "device")))
            if os.path.exists(os.path.join(root, text)) and PCI_ADDRESS.fullmatch(function):
                return function
    raise argparse.ArgumentTypeError(
        f"{text!r} is not 'sim', 'sim:NAME', a PCI address (0000:41:00.0), or a network interface or RDMA device "
        f"on a PCI function ({' and '.join(SYSFS_CLASSES)} have none by that name)")


def connection(text: str) -> str:
    """-c: perftest's connection types; aiofabric's QPs are RC."""
    if text.upper() not in CONNECTIONS:
        raise argparse.ArgumentTypeError(f"unknown connection type {text!r}: perftest's are {', '.join(CONNECTIONS)}")
    if text.upper() != "RC":
        raise argparse.ArgumentTypeError(f"{text.upper()}: aiofabric runs RC (reliable connected) QPs only")
    return "RC"


def ib_port(text: str) -> int:
    """-i: the RoCE port of the PCI function; a BNXT function has one, port 1."""
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"{text}: a BNXT PCI function has one RoCE port, port 1")
    return 1


def add_perftest_flags(parser: argparse.ArgumentParser, tool: str) -> None:
    """perftest's flags of ib_*_bw (tool "bench") or ib_*_lat ("lat"), in perftest's --help order, with our long
    spellings beside theirs; then the refused ones (hidden from --help, listed in its epilog)."""
    bench = tool == "bench"
    group = parser.add_argument_group("perftest's options (its spellings and ours, in its order)")
    add = group.add_argument
    add("-a", "--all", action="store_true", help="sweep sizes 2 B .. 8 MiB in powers of two, -n iterations each "
                                                 "(perftest's default takes minutes on the emulated NIC: the banner "
                                                 "says so)")
    add("-A", "--atomic_type", choices=ATOMIC_TYPES, help="with the atomic test: the operation (default "
                                                           "FETCH_AND_ADD)")
    if bench:
        add("-b", "--bidirectional", action="store_true", help="both NICs of a pair send at once")
    add("-c", "--connection", type=connection, default="RC", help="connection type: RC (the only one aiofabric runs)")
    if not bench:
        add("-C", "--report-cycles", dest="cycles", action="store_true",
            help="report times in CPU cycles (at the clock /proc/cpuinfo gives) instead of microseconds")
    add("-d", "--ib-dev", "--nic", dest="nic", type=device, default="sim",
        help="'sim' (emulated NICs, the default), 'sim:NAME', a PCI address, or a network interface or RDMA device "
             "name (resolved through sysfs to its PCI function)")
    if bench:
        add("-D", "--duration", type=float, metavar="SECONDS",
            help="run each size this long instead of -n (the first -f seconds, default 20%% up to 2 s, are warm-up)")
    add("-e", "--events", action="store_true", help="sleep on the completion interrupt as soon as the CQs are empty "
                                                    "(default: poll a short while first)")
    if bench:
        add("-f", "--margin", type=seconds_or_zero, metavar="SECONDS",
            help="with -D: the warm-up before measuring (default 20%% of -D, at most 2 s)")
    add("-F", "--CPU-freq", dest="cpu_freq", action="store_true",
        help="accepted, as perftest (aiofabric prints no cpufreq warning)")
    if not bench:
        add("-H", "--report-histogram", "--report-histogrm", dest="sorted_samples", action="store_true",
            help="print every sample, sorted, as perftest (without the two largest), before the table's row")
    add("-i", "--ib-port", type=ib_port, default=1, help="the RoCE port: 1 (a BNXT function has one)")
    add("-I", "--inline_size", "--inline-size", dest="inline_size", type=integer(0), metavar="BYTES",
        help="send messages up to this size inline, inside the WQE (at most the NIC's max_inline_data, 96 on the "
             "emulated NIC; default " + ("0)" if bench else f"{NETXTREME_LAT_INLINE} for write and send, as perftest "
                                                               "on a NetXtreme device)"))
    if bench:
        add("-l", "--post_list", "--post-list", dest="post_list", type=int, default=1, metavar="N",
            help="post N work requests per call, one doorbell each (QueuePair.post_many; default 1)")
    add("-m", "--mtu", type=int, default=4096, choices=MTUS, help="path MTU (default 4096)")
    add("-n", "--iters", type=int, metavar="N", help="iterations per QP (default "
        + ("5000 for write, 1000 for the others" if bench else str(DEF_ITERS))
        + ("; with --min-size/--max-size: about a second's worth per size)" if bench else ")"))
    if bench:
        add("-N", "--noPeak", dest="no_peak", action="store_true", help="do not compute the peak bandwidth (0)")
    add("-o", "--outs", type=int, metavar="N", help="outstanding RDMA READ/atomic requests per QP (default: the "
                                                   "NIC's max_qp_rd_atom)")
    if bench:
        add("-q", "--qp", "--qps", dest="qps", type=int, default=1, help="queue pairs (default 1)")
        add("-Q", "--cq-mod", dest="cq_mod", type=int, metavar="N",
            help=f"signal one completion every N work requests (default {DEF_CQ_MOD}, or 1 above "
                 f"{MSG_SIZE_CQ_MOD_LIMIT} B without -a or -e; at most --tx-depth; with -l: each list's last)")
        add("-r", "--rx-depth", dest="rx_depth", type=int, metavar="N",
            help="send: receive queue depth (default and minimum: --tx-depth)")
    add("-s", "--size", type=size, default=DEF_SIZE_BW if bench else DEF_SIZE_LAT,
        help=f"message size: bytes or with a K/M/G suffix, powers of 1024 (default {'64K' if bench else 2})")
    if bench:
        add("-t", "--tx-depth", "--depth", dest="depth", type=int, default=DEF_TX_BW,
            help=f"work requests in flight per QP (default {DEF_TX_BW}; no more than -n)")
    add("-u", "--qp-timeout", "--timeout", dest="timeout", type=int, default=14,
        help="QP ACK timeout exponent: 4.096 us * 2^N (default 14: 67 ms; 0 waits forever)")
    if not bench:
        add("-U", "--report-unsorted", dest="unsorted", action="store_true",
            help="print every sample in the order measured, before the table's row")
    add("-V", "--version", action=VersionAction, help="print the version")
    add("-x", "--gid-index", dest="gid_index", type=integer(0), metavar="INDEX",
        help="the GID index to use: the NIC's own (0 on the emulated NIC; see `aiofabric info`)")
    add("--out_json", action="store_true", help=f"also write the report as JSON to --out_json_file (default "
                                                f"{DEFAULT_JSON_FILE}), with perftest's keys besides ours")
    add("--out_json_file", "--json-file", dest="json_file", metavar="FILE",
        help="the file --out_json writes (giving it implies --out_json)")
    add("--output", choices=OUTPUTS, help="print only this number: " + ", ".join(
        BENCH_OUTPUTS if bench else LAT_OUTPUTS) + (" (in the table's unit)" if bench else " (t_avg)"))
    if bench:
        add("--report-both", action="store_true", help="accepted: with -b each direction is reported anyway")
        add("--report_gbits", "--report-gbits", dest="report_gbits", action="store_true",
            help="bandwidth in Gb/sec (10^9 bits) instead of MiB/sec")
        add("--run_infinitely", "--run-infinitely", dest="run_infinitely", action="store_true",
            help="run until Ctrl-C, a report line every -D seconds (default 5); Ctrl-C prints the table")
    add("--mr_per_qp", action="store_true", help="accepted: each QP has its own memory regions anyway")
    if not bench:
        add("--perform_warm_up", action="store_true",
            help="accepted: lat always runs --warmup iterations first (perftest's latency tests ignore this flag)")
    refused = _refuse(parser, REFUSED + (BENCH_REFUSED if bench else LAT_REFUSED))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog as wrapped here: whole flags per line
    parser.epilog = textwrap.fill("perftest options refused, naming why (aiofabric does not do them): "
                                  + " ".join(refused), width=100, break_on_hyphens=False, break_long_words=False)


def typed_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """{dest: the option string the user typed last for it} over `argv` and its subcommands' parsers."""
    actions: dict[str, argparse.Action] = {}
    stack = [parser]
    while stack:
        current = stack.pop()
        actions.update(current._option_string_actions)
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    typed = {}
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        key = token.partition("=")[0] if token.startswith("--") else token if token in actions else token[:2]
        if key in actions:
            typed[actions[key].dest] = key
    return typed


def usage_message(error: BadOption, typed: dict[str, str]) -> str:
    """A BadOption under the spelling the user typed: "-q 100000: ..." ("--qps ..." when it came from elsewhere)."""
    return f"{typed.get(error.dest, '--' + error.dest.replace('_', '-'))} {error.value}: {error.reason}"
