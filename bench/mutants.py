"""Mutation check of the hot spots: one deliberate bug at a time, and the tests that must catch it.

Each mutant replaces one snippet of one file (it must occur there exactly once) in a temporary copy of the checkout
(its tracked and untracked files; the checkout itself is never modified) and runs its tests there. A mutant its
tests do not fail survived: some behaviour is not checked. The tests first run unmutated, so a failure is the
mutant's, not the tree's.

    python bench/mutants.py              # every mutant; exit status 1 if one survived or could not be applied
    python bench/mutants.py -k retire    # the mutants whose name contains "retire"
    python bench/mutants.py --list
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]  # pytest node ids (a test function's id selects all its parameters)


ICRC, RESPONDER, WORKQUEUE = "aiofabric/sim/icrc.py", "aiofabric/sim/responder.py", "aiofabric/verbs/workqueue.py"
RUNS = "aiofabric/verbs/sq_runs.py"
PLAN, OPERATIONS = "aiofabric/sched/plan.py", "aiofabric/peer/operations.py"
DEVICE, SAMPLES = "aiofabric/driver/device.py", "aiofabric/tools/samples.py"
SCAPY_ICRC = ("tests/unit/test_packets.py::test_scapy_parses_our_packets_and_computes_the_same_icrc",
              "tests/unit/test_packets.py::test_icrc_over_nonzero_ip_ids_matches_scapy",
              "tests/unit/test_packets.py::test_golden_capture_decodes_and_reencodes_bit_exactly")
SIM = "tests/emulator/test_sim_datapath.py::"
DATAPATH = "tests/driver/test_datapath.py::"
# every firmware profile
UNDER_LOSS = "tests/driver/test_chip_gating.py::test_writes_under_loss_are_retransmitted_intact"
MSN = (DATAPATH + "test_msn_table_entries_name_each_messages_psns_and_wqe_as_the_wire_does", UNDER_LOSS)
RETIRE = (DATAPATH + "test_unsignaled_work_before_a_failing_request_completes_without_its_error",
          DATAPATH + "test_hundreds_in_flight_unsignaled_retired_and_sq_wraps",
          DATAPATH + "test_bad_rkey_fails_with_remote_access_error_and_flushes_the_rest")
PLANNING = ("tests/unit/test_sched_plan.py",)
CODEC_MODEL = "tests/unit/test_workqueue.py::test_the_codec_matches_the_model"
CODEC_FAST = "tests/unit/test_workqueue.py::test_the_fast_paths_write_what_post_writes"
POST_BULK = "tests/unit/test_post_bulk.py"
BULK_UNDER_LOSS = ("tests/driver/test_post_many.py::test_batches_under_loss_are_retransmitted_intact_from_the_search_"
                   "entries_they_wrote")
CQ_BULK = "tests/unit/test_cq_bulk.py"
PEER_REQUESTS = ("tests/system/test_peer.py::test_bad_requests_name_what_is_wrong_and_keep_their_id",)
LIFETIMES = "tests/driver/test_lifetimes.py::"
CLOSE = (LIFETIMES + "test_a_close_destroys_what_is_attached_in_an_order_the_firmware_accepts",
         LIFETIMES + "test_close_inside_the_block_stops_the_nics_own_tasks_before_freeing_their_rings",
         LIFETIMES + "test_creations_cancelled_at_random_moments_leave_no_orphan_objects",
         LIFETIMES + "test_objects_of_a_closed_nic_refuse_use")
SUMMARY = ("tests/unit/test_samples.py",)
B = "tests/driver/test_boundaries.py::"
POOL, CALLS, WORKERS, BINDING = ("aiofabric/sched/pool.py", "aiofabric/sched/calls.py", "aiofabric/sched/workers.py",
                                 "aiofabric/sched/binding.py")
COMM, LAYOUT, STEPS = ("aiofabric/collectives/communicator.py", "aiofabric/collectives/layout.py",
                       "aiofabric/collectives/steps.py")
FREED, IOMMU, PCI = "aiofabric/sim/freed.py", "aiofabric/pci/iommu.py", "aiofabric/pci/seam.py"
FLAGS, POLICY = "aiofabric/tools/perftest_flags.py", "aiofabric/peer/policy.py"
DATAPATH_SIM, UDP, RCFW, PCAP = ("aiofabric/sim/datapath.py", "aiofabric/sim/udp.py", "aiofabric/sim/rcfw.py",
                                  "aiofabric/sim/pcap.py")
PRIVATE, SERVE = "aiofabric/util/private.py", "aiofabric/peer/serve.py"
FORGED, LOCAL_FILES = "tests/emulator/test_forged_packets.py::", "tests/system/test_local_files.py::"
POOL_DEPTH = (B + "test_a_receive_pool_is_as_deep_as_asked_after_a_reset_and_never_as_deep_as_its_queue",)
IMM = (B + "test_an_expected_immediate_of_0_is_checked_and_0xffffffff_is_the_largest",)
SCALAR = (B + "test_an_rdma_size_rebinds_to_exactly_its_compiled_size_and_a_call_may_end_at_its_regions_end",)
TOUCHING = (B + "test_memory_next_to_a_constant_or_another_input_is_not_an_overlap",)
PIECES = (B + "test_a_runs_messages_on_a_link_fit_the_receive_pool_whatever_the_count",)
BLAME = (B + "test_a_run_that_times_out_names_the_rank_it_waits_for",)
FREED_SPLIT = (B + "test_freed_ranges_split_where_memory_is_allocated_again",)
IOVA = (B + "test_an_iova_block_may_end_on_a_ranges_last_byte_and_a_freed_block_is_handed_out_once",)
BUDGET = (B + "test_a_dma_budget_counts_odd_sizes_in_whole_pages_and_takes_exactly_its_limit",)

MUTANTS = [
    Mutant("icrc: the masked LRH seed is 4 bytes, not 8", ICRC,
           '_ICRC_SEED = zlib.crc32(b"\\xff" * 8)', '_ICRC_SEED = zlib.crc32(b"\\xff" * 4)', SCAPY_ICRC),
    Mutant("icrc: the plain rule leaves BTH byte 4 (FECN/BECN) unmasked", ICRC,
           "    masked[ihl + UDP_HEADER_SIZE + 4] = 0xFF\n", "", ("tests/unit/test_packets.py",)),
    Mutant("nak: the packets behind one refused with an RNR NAK earn a sequence NAK", RESPONDER,
           "if self.nak_sent or racing:", "if racing:",
           (SIM + "test_lost_packet_is_recovered_by_nak_sequence",
            "tests/driver/test_soak.py::test_a_send_before_its_receive")),
    Mutant("nak: a packet reordered behind a NAKed one earns a second NAK", RESPONDER,
           "racing = self.go_back_due and psn_diff(psn, self.dropped_hi) > 0", "racing = False",
           (SIM + "test_a_reordered_pair_earns_one_nak_and_one_go_back",
            SIM + "test_a_lost_retransmission_is_a_new_gap_with_its_own_nak")),
    Mutant("wqe: immediate and length swapped in the one-SGE WQE", WORKQUEUE,
           "flags, _ONE_SLOTS, imm, length, remote_va, rkey,", "flags, _ONE_SLOTS, length, imm, remote_va, rkey,",
           (DATAPATH + "test_write_lands_exactly_across_message_sizes", CODEC_FAST)),
    Mutant("wqe: immediate and length swapped in the RDMA header of any WQE", WORKQUEUE,
           "SQ_RDMA_HEADER.pack(wqe_type, flags, size, imm, length,",
           "SQ_RDMA_HEADER.pack(wqe_type, flags, size, length, imm,", (CODEC_MODEL,)),
    Mutant("msn: start PSN and next PSN swapped in the MSN entry", WORKQUEUE,
           "self.table_mask) << _MSN_SHIFT),\n                      psn << _SP | next_psn << _NP",
           "self.table_mask) << _MSN_SHIFT),\n                      next_psn << _SP | psn << _NP", MSN + (CODEC_FAST,)),
    Mutant("msn: start PSN and next PSN swapped in the MSN entry of any WQE", WORKQUEUE,
           "msn_entry(psn, next_psn, start_slot)", "msn_entry(next_psn, psn, start_slot)", (CODEC_MODEL,)),
    Mutant("msn: every message writes the same MSN entry", WORKQUEUE,
           "        self.msn = msn + 1\n", "        self.msn = msn + 0\n", MSN),
    Mutant("psn search: start PSN and next PSN swapped in the search entry", WORKQUEUE,
           "psn_search_values(wqe_type, psn, next_psn, start_slot)",
           "psn_search_values(wqe_type, next_psn, psn, start_slot)", (UNDER_LOSS, CODEC_MODEL)),
    Mutant("psn search: start PSN and next PSN swapped in the one-SGE WQE's search entry", WORKQUEUE,
           "psn_search_values(wqe_type, psn, next_psn, slot)", "psn_search_values(wqe_type, next_psn, psn, slot)",
           (UNDER_LOSS, CODEC_FAST)),
    Mutant("runs: start PSN and next PSN swapped in a run's MSN entries", RUNS,
           "first = psn << _SP | (psn + npsn) << _NP | start << _SI",
           "first = (psn + npsn) << _SP | psn << _NP | start << _SI", (POST_BULK, BULK_UNDER_LOSS)),
    Mutant("runs: a run's PSN search entries give the next PSN as the first", RUNS,
           "(self._opcode(wqe_type) | psn, psn + npsn, start)", "(self._opcode(wqe_type) | (psn + npsn), psn, start)",
           (POST_BULK, BULK_UNDER_LOSS)),
    Mutant("runs: a static WQE's local address lands in the remote's word", RUNS,
           "columns = [(LOCAL_WORD, local), (REMOTE_WORD, remote)]",
           "columns = [(REMOTE_WORD, local), (LOCAL_WORD, remote)]", (POST_BULK,)),
    Mutant("runs: variable WQEs that wrap are written from slot 0 again", RUNS,
           "self.view[:run.size - head] = packed[head:]", "self.view[:run.size - head] = packed[:run.size - head]",
           (POST_BULK,)),
    Mutant("cq: a poll takes the CQEs after the first stale one", "aiofabric/hw/ring.py",
           "                return found + stale\n", "                return found + len(bits)\n", (CQ_BULK,)),
    Mutant("retire: unsignaled work before a failing request gets its error", WORKQUEUE,
           "while pending and pending[0][0] < target:", "while pending and pending[0][0] < target - 1:",
           RETIRE + (CODEC_MODEL,)),
    Mutant("retire: a failing request's completion succeeds", WORKQUEUE,
           "while pending and pending[0][0] < target:", "while pending and pending[0][0] <= target:",
           RETIRE + (CODEC_MODEL,)),
    Mutant("retire: the consumer index is read modulo 2^16, not modulo sq_size", WORKQUEUE,
           "distance = (sq_cons_idx - self.retired) % self.size", "distance = (sq_cons_idx - self.retired) & 0xFFFF",
           ("tests/unit/test_workqueue.py::test_retirement_survives_many_wraps_of_the_index",
            "tests/driver/test_post_many.py::test_completions_name_their_work_requests_through_many_wraps_of_the_"
            "index")),
    Mutant("retire: a variable-WQE error CQE's slot is read as a WQE index", WORKQUEUE,
           "if status and self.variable:", "if False:",
           ("tests/unit/test_workqueue.py::test_an_error_cqe_blames_the_work_request_it_names",
            "tests/driver/test_post_many.py::test_an_error_completion_blames_its_own_work_request_among_wqes_of_many_"
            "sizes")),
    Mutant("plan: a write does not wait for earlier readers (write-after-read)", PLAN,
           "if segment.readers:  # every reader", "if False:  # every reader", PLANNING),
    Mutant("plan: a write does not wait for the earlier writer (write-after-write)", PLAN,
           "elif segment.writer is not None:", "elif False:", PLANNING),
    Mutant("protocol: true is an integer (and handle 1)", OPERATIONS,
           "if isinstance(value, bool) or not isinstance(value, int):", "if not isinstance(value, int):",
           PEER_REQUESTS),
    Mutant("protocol: handle 0 is a handle", OPERATIONS, "if _int(value) < 1:", "if _int(value) < 0:", PEER_REQUESTS),
    Mutant("protocol: true is a deadline", OPERATIONS,
           "if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:",
           "if not isinstance(value, (int, float)) or not value > 0:", PEER_REQUESTS),
    Mutant("close: the NIC's own tasks keep running while it frees their rings", DEVICE,
           "            for scope in self._background:", "            for scope in ():", CLOSE),
    Mutant("close: CQs and MRs are destroyed before the QPs that use them", DEVICE,
           "key=lambda o: o.release_order)", "key=lambda o: -o.release_order)", CLOSE),
    Mutant("percentile: one index too low (nearest rank, not perftest's index)", SAMPLES,
           "return ordered[min(index, len(ordered) - 1)]", "return ordered[max(0, index - 1)]", SUMMARY),
    Mutant("percentile: float error takes 99.9% of 41000 one index up", SAMPLES,
           "index = math.ceil(round(count * p / 100, 9))", "index = math.ceil(count * p / 100)", SUMMARY),
    # the boundaries, zero, recovery, reuse after a free, odd sizes and error texts (tests/driver/test_boundaries.py)
    Mutant("pool: a take after a QP reset posts one receive, not the pool's depth", POOL,
           "        await self.fill()\n        self.posted.append", "        self.posted.append", POOL_DEPTH),
    Mutant("pool: a pool keeps one receive more than its depth", POOL,
           "while len(self.posted) < self.depth:", "while len(self.posted) <= self.depth:", POOL_DEPTH),
    Mutant("pool: a depth equal to the receive queue's (no room left for a run's own) is accepted", POOL,
           "not 1 <= depth < qp.rq.depth", "not 1 <= depth <= qp.rq.depth", POOL_DEPTH),
    Mutant("imm: an expected immediate of 0 is never checked", WORKERS,
           "if want is not None and done.imm != want:", "if want and done.imm != want:", IMM),
    Mutant("imm: wait_imm refuses an immediate of 0", CALLS,
           "not 0 <= imm <= 0xFFFFFFFF", "not 0 < imm <= 0xFFFFFFFF", IMM),
    Mutant("imm: wait_imm refuses 0xffffffff", CALLS,
           "not 0 <= imm <= 0xFFFFFFFF", "not 0 <= imm < 0xFFFFFFFF", IMM),
    Mutant("scalar: an RDMA size rebound to exactly its compiled value is refused", BINDING,
           "not 0 <= value <= limit", "not 0 <= value < limit", SCALAR),
    Mutant("rdma range: a call ending exactly at its region's end is refused", CALLS,
           "offset + size > length:", "offset + size >= length:", SCALAR),
    Mutant("binding: memory right after a constant argument counts as overlapping it", BINDING,
           "(self._constant_starts < stop) & (self._constant_stops > start)",
           "(self._constant_starts <= stop) & (self._constant_stops >= start)", TOUCHING),
    Mutant("binding: two inputs side by side count as overlapping", BINDING,
           "e[0] < extent[1] and extent[0] < e[1]", "e[0] <= extent[1] and extent[0] <= e[1]", TOUCHING),
    Mutant("collective: a buffer of exactly the communicator's capacity is refused", COMM,
           "if buffer_bytes > self.capacity:", "if buffer_bytes >= self.capacity:",
           (B + "test_a_collective_of_exactly_the_buffers_capacity_runs",)),
    Mutant("collective: pieces per chunk rounded down (one more message than the pool holds)", STEPS,
           "-(-elements_per_message_group // share)", "elements_per_message_group // share", PIECES),
    Mutant("collective: a timeout on a receive queue blames no rank", COMM,
           'queue.removesuffix(" recv") ==', "queue ==", BLAME),
    Mutant("collective: a timeout blames the rank as a failed link", COMM,
           "timed_out = not isinstance(error, CallError)", "timed_out = isinstance(error, CallError)", BLAME),
    Mutant("collective: the last sequence number (0xffff) a message carries is refused", LAYOUT,
           "if not 1 <= seq <= MAX_SEQ:", "if not 1 <= seq < MAX_SEQ:",
           (B + "test_the_last_sequence_number_a_message_can_carry_is_0xffff",)),
    Mutant("freed: allocating the middle of a freed range forgets its left remnant", FREED,
           "                kept.append((start, offset))\n", "                pass\n", FREED_SPLIT),
    Mutant("freed: allocating the middle of a freed range forgets its right remnant", FREED,
           "                kept.append((end, stop))\n", "                pass\n", FREED_SPLIT),
    Mutant("iova: a block ending on a valid range's last byte is refused", IOMMU,
           "if start + block - 1 <= last:", "if start + block - 1 < last:", IOVA),
    Mutant("iova: a freed block is handed out twice", IOMMU,
           "return self._free[block].pop()", "return self._free[block][-1]", IOVA),
    Mutant("iova: the block of a failed mapping is never given back", IOMMU,
           "            self.space.free(iova, size)\n            hint", "            hint",
           (B + "test_the_iova_of_a_failed_mapping_serves_the_next",)),
    Mutant("dma: the byte past a buffer has a bus address", PCI,
           "if not 0 <= offset < self.size:", "if not 0 <= offset <= self.size:",
           (B + "test_a_dma_buffers_last_byte_has_a_bus_address_and_the_byte_past_it_none",)),
    Mutant("dma budget: an allocation reaching exactly the limit is refused", PCI,
           "if self.in_use + length > self.limit:", "if self.in_use + length >= self.limit:", BUDGET),
    Mutant("dma budget: odd sizes are counted as asked, not in the whole pages they hold", PCI,
           "length = -(-max(size, 1) // PAGE_SIZE) * PAGE_SIZE", "length = max(size, 1)", BUDGET),
    Mutant("flags: a short flag with its value joined (-q0) is named by its long form", FLAGS,
           "token if token in actions else token[:2]", "token",
           (B + "test_a_flag_with_its_value_joined_is_named_as_typed",)),
    Mutant("policy: an idle timeout of 0 is accepted", POLICY, "if not self.idle > 0:", "if not self.idle >= 0:",
           (B + "test_server_limits_take_their_smallest_values_and_refuse_zero",)),
    Mutant("close: host memory is freed before the device is quiesced", DEVICE,
           "            await self._quiesce()\n            await self._free_memory()\n",
           "            await self._free_memory()\n            await self._quiesce()\n",
           ("tests/driver/test_orderings.py::test_a_close_frees_nothing_the_device_writes_up_to_its_quiesce",)),
    # trust boundaries: what another local user or a forged packet meets
    Mutant("wire: a QP takes a packet from any source address", DATAPATH_SIM,
           "        if src_ip != ctx.peer_ip or dst_ip != self.ip:\n", "        if dst_ip != self.ip:\n",
           (FORGED + "test_a_packet_not_between_the_qp_and_its_peer_is_dropped",
            FORGED + "test_a_forged_acknowledgement_completes_nothing")),
    Mutant("wire: the UDP transport takes a loopback sender on any port", UDP,
           "if src_port != ROCE_PORT and source[0] == 127:", "if src_port != ROCE_PORT and source[0] == 126:",
           ("tests/emulator/test_wire.py::test_a_loopback_sender_not_on_4791_is_dropped_for_its_port",)),
    Mutant("wire: the compiled receive takes a loopback sender on any port", "aiofabric/sim/wirecodec.c",
           "if (r->src_port != ROCE_PORT && name[4] == 127) {", "if (r->src_port != ROCE_PORT && name[4] == 126) {",
           ("tests/emulator/test_wire.py::test_a_loopback_sender_not_on_4791_is_dropped_for_its_port",)),
    Mutant("keys: every NIC's first key byte is the same", RCFW, "        byte = secrets.randbits(8)\n        while",
           "        byte = 7\n        while", (FORGED + "test_two_firmware_instances_draw_different_key_bytes",)),
    Mutant("private: a directory of another user is trusted", PRIVATE, "if info.st_uid != os.geteuid():",
           "if info.st_uid != os.geteuid() and info.st_uid != 65534:",
           (LOCAL_FILES + "test_a_cache_directory_owned_by_another_user_is_refused",
            LOCAL_FILES + "test_a_lock_directory_owned_by_another_user_is_refused")),
    Mutant("private: a group-writable directory is trusted", PRIVATE, "((0o020, \"group\"), (0o002, \"others\"))",
           "((0o000, \"group\"), (0o002, \"others\"))",
           (LOCAL_FILES + "test_a_cache_directory_others_can_write_is_refused",)),
    Mutant("pcap: a capture follows a symlink and overwrites", PCAP,
           "os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW",
           "os.O_WRONLY | os.O_CREAT | os.O_TRUNC",
           (LOCAL_FILES + "test_a_symlink_at_the_capture_path_is_refused_and_its_target_unchanged",)),
    Mutant("server: a request still running counts as its client's idleness", SERVE, "            if unanswered:\n",
           "            if False:\n", ("tests/unit/test_server_idle.py",)),
    Mutant("reservation: an allocation past FUNC_CFG's grant is taken", "aiofabric/sim/resources.py",
           "        if in_use >= granted:\n", "        if in_use > granted:\n",
           ("tests/emulator/test_sim_firmware.py::test_each_allocation_counts_against_its_reservation_up_to_the_grant"
            "_and_not_one_past",)),
    Mutant("reservation: an NQ's vector may be the first past num_msix", "aiofabric/sim/hwrm.py",
           'request.logical_id >= self.reservation.granted["num_msix"]',
           'request.logical_id > self.reservation.granted["num_msix"]',
           ("tests/emulator/test_sim_firmware.py::test_an_nqs_vector_is_one_of_the_msix_vectors_reserved",)),
    Mutant("events: a reset notice from the event ring waits behind a link change's query", "aiofabric/driver/device.py",
           "functools.partial(reader.serve, self._event_ring_heard)",
           "functools.partial(reader.serve, self._on_firmware_event)",
           ("tests/driver/test_firmware_events.py::test_a_reset_notice_behind_a_link_change_whose_query_the_firmware"
            "_leaves_unanswered_is_heard_at_once",)),
    Mutant("event stream: a full stream takes one more than its buffer", "aiofabric/verbs/events.py",
           "        if len(self._held) >= self._buffer:\n", "        if len(self._held) > self._buffer:\n",
           ("tests/driver/test_event_stream.py::test_a_full_stream_drops_its_oldest_events_and_says_how_many_where_they"
            "_were",)),
    Mutant("compare: a figure exactly at the tolerance is a regression", "aiofabric/tools/compare.py",
           "worse > tolerance * abs(base)", "worse >= tolerance * abs(base)", ("tests/tools/test_compare.py::test_judge",)),
    Mutant("plot: a path in a missing directory is found only after the run", "aiofabric/tools/plot.py",
           "    if not os.path.isdir(folder):\n", "    if False:\n",
           ("tests/tools/test_lat_plot.py::test_where_the_plot_cannot_go_is_said_before_the_run",)),
    Mutant("qp error: only one poll's usual budget of written CQEs is delivered before the flush",
           "aiofabric/verbs/qp.py", "        self.send_cq.poll(self.send_cq.ring.depth)\n",
           "        self.send_cq.poll()\n",
           ("tests/driver/test_cq_errors.py::test_a_qp_error_delivers_every_completion_written_before_it_however_many",)),
    Mutant("rendezvous: rank 0 dying during a round is a closed connection, not the rendezvous gone",
           "aiofabric/collectives/rendezvous.py", 'raise RendezvousError(f"rank {self.rank}: {self.gone()}',
           'raise RendezvousError(f"rank {self.rank}: closed',
           ("tests/system/test_join_failure.py::test_a_rendezvous_that_drops_a_rank_mid_round_is_named_gone_as_between"
            "_rounds",)),
    Mutant("emulator: it dies with the thread that started it (PR_SET_PDEATHSIG)", "aiofabric/sim/process.py",
           "    _prctl(PR_SET_TIMERSLACK, 1)  # microsecond firmware latencies need precise sleeps\n",
           "    _prctl(PR_SET_TIMERSLACK, 1)\n    _prctl(1, 9)\n",
           ("tests/emulator/test_sim_lifecycle.py::test_nic_outlives_the_worker_thread_that_started_it",)),
]


def copy_checkout(destination: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, listed.split(b"\0")):
        source = ROOT / os.fsdecode(name)
        if source.is_file():  # a tracked file deleted in the checkout is not copied
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest's exit status (None: timed out) and the last line it printed, run in `tree` on `tree`'s package."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH")))),
           "PYTHONDONTWRITEBYTECODE": "1"}  # a mutant and its undoing may fit in one second of the same size
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", *tests]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no result within {timeout:g} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="match", default="", help="only the mutants whose name contains this")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one mutant's tests (default 600)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.match in m.name]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name}\n  {mutant.path}: {mutant.original.strip()!r} -> {mutant.mutated.strip()!r}\n"
                  + "".join(f"  {test}\n" for test in mutant.tests), end="")
        return 0
    with tempfile.TemporaryDirectory(prefix="aiofabric-mutants-") as temporary:
        tree = Path(temporary)
        copy_checkout(tree)
        unapplied = [m for m in mutants if (tree / m.path).read_text().count(m.original) != 1]
        for mutant in unapplied:
            print(f"NOT APPLIED  {mutant.name}: {mutant.original.strip()!r} is not in {mutant.path} exactly once")
        baseline = tuple(dict.fromkeys(test for m in mutants for test in m.tests))
        status, last = run_tests(tree, baseline, args.timeout)
        if status != 0:
            print(f"the tests fail unmutated ({last}): fix the tree first")
            return 2
        survivors = []
        for mutant in (m for m in mutants if m not in unapplied):
            path = tree / mutant.path
            original = path.read_text()
            path.write_text(original.replace(mutant.original, mutant.mutated))
            started = time.monotonic()
            try:
                status, last = run_tests(tree, mutant.tests, args.timeout)
            finally:
                path.write_text(original)
            verdict = "SURVIVED" if status == 0 else "killed"
            if status == 0:
                survivors.append(mutant)
            print(f"{verdict:8}  {mutant.name} ({time.monotonic() - started:.0f} s: {last})", flush=True)
    print(f"{len(mutants) - len(survivors) - len(unapplied)} of {len(mutants)} mutants killed"
          + "".join(f"\nsurvived: {m.name}" for m in survivors))
    return 1 if survivors or unapplied else 0


if __name__ == "__main__":
    sys.exit(main())
