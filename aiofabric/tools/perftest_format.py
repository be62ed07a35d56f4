"""perftest's report text, as its sources print it (src/perftest_parameters.h's RESULT_* and REPORT_* formats,
ctx_print_test_info and write_test_info_to_file in src/perftest_parameters.c), so that a script written for its
output reads ours: the banner, the result header, each row, and the --out_json "test_info" keys."""
from __future__ import annotations

import dataclasses
from typing import Any

from .options import TEST_TITLES

RESULT_LINE = "-" * 87
RESULT_FMT = " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"
RESULT_FMT_G = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
REPORT_FMT = " %-7d    %-10d       %-7.2f            %-7.2f\t\t     %-7.6f"
REPORT_FMT_EXT = " %-7d    %d           %-7.6f            %-7.6f            %-7.6f"  # Gb/sec below 0.1
RESULT_FMT_LAT = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
                  "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ")
REPORT_FMT_LAT = " %-7d %d          %-7.2f        %-7.2f      %-7.2f  \t       %-7.2f     \t%-7.2f\t\t%-7.2f \t\t%-7.2f"
SAMPLES_TITLE = "#, %s"  # -H and -U: a title, then "%d, %g" per sample
SLOW_BYTES = 4 << 30  # a run that moves more than this through emulated NICs takes minutes: the banner says so


def bw_header(report_gbits: bool) -> str:
    return RESULT_FMT_G if report_gbits else RESULT_FMT


def bw_row(size: int, iterations: int, peak: float, average: float, rate_mpps: float, report_gbits: bool) -> str:
    """One row of the BW table; in Gb/sec below 0.1 perftest prints six decimals (REPORT_FMT_EXT)."""
    return (REPORT_FMT_EXT if report_gbits and average < 0.1 else REPORT_FMT) % (size, iterations, peak, average,
                                                                                 rate_mpps)


def extended_accuracy(average: float, report_gbits: bool) -> bool:
    """Whether perftest gives this row six decimals (its inc_accuracy), in the table and in --out_json."""
    return report_gbits and average < 0.1


def lat_row(size: int, iterations: int, values: list[float]) -> str:
    """One row of the latency table: t_min, t_max, t_typical, t_avg, t_stdev, 99% and 99.9%."""
    return REPORT_FMT_LAT % (size, iterations, *values)


def samples(values: list[float], unit: str) -> list[str]:
    """-H's or -U's list: a title, then one "n, value" line per sample, counted from 1."""
    return [SAMPLES_TITLE % unit] + [f"{i}, {value:g}" for i, value in enumerate(values, 1)]


def slow_note(moved: int, iters: int, sweep: bool) -> list[str]:
    """aiofabric's one line in perftest's banner: when perftest's numbers (-n, -s, -a) make a run on emulated NICs
    move more than SLOW_BYTES, their meaning is kept and the banner says it will take minutes."""
    if moved <= SLOW_BYTES:
        return []
    return [f" Note            : {moved / 2**30:.1f} GiB to move ({iters} iterations{' of each size' if sweep else ''}"
            ", as perftest): minutes on the emulated NIC; -n runs fewer"]


@dataclasses.dataclass(frozen=True)
class TestInfo:
    """What perftest's banner (and --out_json's "test_info") says about a run, in its order. None: a line perftest
    leaves out for this run."""
    test: str  # bench's or lat's test
    kind: str  # "BW" or "Latency"
    device: str  # -d
    qps: int
    mtu: int
    tx_depth: int
    atomic_type: str | None = None  # the atomic test's -A
    bidirectional: bool = False
    post_list: int = 1
    rx_depth: int | None = None  # printed for a send test with -b
    cq_mod: int | None = None  # BW tests
    gid_index: int | None = None  # printed when -x was given
    inline_size: int = 0  # write and send
    outs: int | None = None  # read and atomic: outstanding requests
    events: bool = False

    def words(self) -> list[str]:
        """The words of its title ("RDMA_Write", "BW", "Test", ...)."""
        return [TEST_TITLES[self.test], *([self.atomic_type] if self.atomic_type else []),
                *(["Bidirectional"] if self.bidirectional else []),
                *(["Post List"] if self.post_list > 1 else []), self.kind, "Test"]

    def lines(self, notes: list[str] | None = None) -> list[str]:
        """ctx_print_test_info's banner, between its two RESULT_LINEs (the lines that say nothing true of
        aiofabric, about PCIe relaxed ordering, libibverbs' post API and CQE polling, are left out); `notes` (see
        `slow_note`) before the closing one."""
        lines = [RESULT_LINE, "                    " + " ".join(self.words()),
                 *([f" Test with events. Using {self.device}_comp0"] if self.events else []),
                 f" Dual-port       : OFF\t\tDevice         : {self.device}",
                 f" Number of qps   : {self.qps}\t\tTransport type : IB",
                 " Connection type : RC\t\tUsing SRQ      : OFF",
                 f" TX depth        : {self.tx_depth}",
                 *([f" Post List       : {self.post_list}"] if self.post_list > 1 else []),
                 *([f" RX depth        : {self.rx_depth}"] if self.rx_depth is not None else []),
                 *([f" CQ Moderation   : {self.cq_mod}"] if self.cq_mod is not None else []),
                 f" Mtu             : {self.mtu}[B]",
                 " Link type       : Ethernet",
                 *([f" GID index       : {self.gid_index}"] if self.gid_index is not None else []),
                 f" Outstand reads  : {self.outs}" if self.outs is not None else
                 f" Max inline data : {self.inline_size}[B]",
                 " rdma_cm QPs\t : OFF",
                 " Data ex. method : Ethernet",
                 *(notes or []),
                 RESULT_LINE]
        return lines

    def json(self) -> dict[str, Any]:
        """write_test_info_to_file's "test_info" keys."""
        return {"test": "_".join(word.replace(" ", "_") for word in self.words()),
                **({"Test with events": f"Using_{self.device}_comp0"} if self.events else {}),
                "Dual_port": "OFF", "Device": self.device, "Number_of_qps": self.qps, "Transport_type": "IB",
                "Connection_type": "RC", "Using_SRQ": "OFF", "TX_depth": self.tx_depth,
                **({"Post_List": self.post_list} if self.post_list > 1 else {}),
                **({"RX_depth": self.rx_depth} if self.rx_depth is not None else {}),
                **({"CQ_Moderation": self.cq_mod} if self.cq_mod is not None else {}),
                "Mtu": self.mtu, "Link_type": "Ethernet",
                **({"GID_index": self.gid_index} if self.gid_index is not None else {}),
                **({"Outstand_reads": self.outs} if self.outs is not None else {"Max_inline_data": self.inline_size}),
                "rdma_cm_QPs": "OFF", "Use_ROCm_memory": "OFF", "Use_MUSA_memory": "OFF", "Data_ex_method": "Ethernet"}
