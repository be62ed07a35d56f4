"""The emulated firmware without any I/O: HWRM and RCFW commands, rings, doorbells and object tables, driven the way a
driver would drive them (tests/support/firmware.py's `Driver`: requests built with the bindings, page tables in a
bytearray of host memory)."""
import ctypes
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.hw import doorbell
from aiofabric.hw.async_event import ASYNC_EVENT, ASYNC_EVENT_ENTRY, LINK_UP, EventId, forwarding
from aiofabric.hw.cqe import (CQ_ENTRY, CREQ_COMMAND_EVENT, CREQ_ENTRY, NQ_ENTRY, RequesterErrorReason, creq_type,
                              notification_fields)
from aiofabric.hw.firmware import (CMDQ_INIT, HWRM_SHORT_REQUEST, LINK_SPEED_MBPS, SHORT_REQUEST_SIGNATURE,
                                   host_msn_table, hw_retx_supported, short_commands_required)
from aiofabric.hw.firmware import BackingStoreType as BS
from aiofabric.hw.ring import phase, position, slot
from aiofabric.hw.verbs import QPState
from aiofabric.sim.function import CONTEXT_TYPES
from aiofabric.sim.memory import BUS_BASE, PAGE
from aiofabric.sim.packets import Op, Packet
from aiofabric.sim.objects import CompletionQueue, MemoryProtectionError, NotificationQueue, PageList, walk_pbl
from aiofabric.sim.profiles import PROFILES
from tests.support.firmware import (FAIL, GID, INIT_MASK, INVALID_PARAMETER, L2_CMPL, MAC, NQ, RX, SUCCESS, Driver,
                                    dbc)

RX_BUF_SIZE = bnxt.RING_ALLOC_REQ_ENABLES_RX_BUF_SIZE_VALID
PATH_RX, OUTERMOST = bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_PATH_RX, bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_OUTERMOST


@pytest.fixture
def driver() -> Driver:
    booted = Driver()
    booted.boot()
    return booted


# -- HWRM ----------------------------------------------------------------------------------------------------------
def test_ver_get_echoes_header_and_writes_valid_last():
    host = Driver()
    request = bnxt.hwrm_ver_get_input(req_type=bnxt.HWRM_VER_GET, seq_id=0xBEEF, cmpl_ring=0xFFFF,
                                      resp_addr=host.response, hwrm_intf_maj=1, hwrm_intf_min=10, hwrm_intf_upd=3)
    addr, data = host.fw.hwrm(bytes(request).ljust(128, b"\0"))
    out = bnxt.hwrm_ver_get_output.from_buffer_copy(data)
    assert addr == host.response and len(data) == out.resp_len == ctypes.sizeof(out) and data[-1] == 1
    assert (out.error_code, out.req_type, out.seq_id) == (0, bnxt.HWRM_VER_GET, 0xBEEF)
    assert (out.hwrm_fw_maj_8b, out.hwrm_fw_min_8b, out.hwrm_fw_bld_8b) == (230, 0, 150)
    assert (out.hwrm_intf_maj_8b, out.hwrm_intf_min_8b, out.hwrm_intf_upd_8b) == (1, 10, 3)
    assert (out.max_req_win_len, out.def_req_timeout, out.chip_num) == (bnxt.HWRM_MAX_REQ_LEN, 500, bnxt.CHIP_NUM_57608)


def test_unknown_hwrm_opcode_is_not_supported_and_unanswerable_requests_get_nothing():
    host = Driver()
    request = bnxt.hwrm_cmd_hdr(req_type=0x7777, seq_id=9, resp_addr=host.response)
    _, data = host.fw.hwrm(bytes(request).ljust(bnxt.HWRM_MAX_REQ_LEN, b"\0"))
    err = bnxt.hwrm_err_output.from_buffer_copy(data)
    assert (err.error_code, err.req_type, err.seq_id, err.resp_len, err.valid) == (
        bnxt.HWRM_ERR_CODE_CMD_NOT_SUPPORTED, 0x7777, 9, ctypes.sizeof(bnxt.hwrm_err_output), bnxt.HWRM_RESP_VALID_KEY)
    window = bnxt.HWRM_MAX_REQ_LEN
    assert host.fw.hwrm(bytes(bnxt.hwrm_cmd_hdr(req_type=bnxt.HWRM_VER_GET, resp_addr=0)).ljust(window, b"\0")) is None
    assert host.fw.hwrm(b"\0" * 8) is None


@pytest.mark.parametrize("name, fields", [
    ("ring_alloc", dict(ring_type=9, length=16)),
    ("ring_alloc", dict(ring_type=NQ, length=0)),
    ("ring_alloc", dict(ring_type=L2_CMPL, length=16)),  # no NQ to hang off
    ("ring_alloc", dict(ring_type=RX, length=16, enables=bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID, nq_ring_id=1)),
    ("ring_free", dict(ring_type=RX, ring_id=0x7777)),
    ("vnic_cfg", dict(vnic_id=5)),
    ("port_phy_cfg", dict(enables=bnxt.PORT_PHY_CFG_REQ_ENABLES_LPBK, lpbk=7)),
    ("port_phy_cfg", dict(port_id=3)),
    ("func_qcaps", dict(fid=0x22)),
    ("func_backing_store_qcaps_v2", dict(type=7)),
    ("func_backing_store_cfg_v2", dict(type=0, entry_size=704, num_entries=300)),  # before its QCAPS_V2
    ("stat_ctx_free", dict(stat_ctx_id=3)),
    ("stat_ctx_alloc", dict(stats_dma_addr=0x1000, stats_dma_length=176)),  # DmaFault inside the handler
])
def test_invalid_hwrm_input_gets_invalid_params(name, fields):
    host = Driver()
    host.hwrm(name, expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, **fields)
    assert host.fw.last_error.startswith(f"HWRM {name}")


@pytest.mark.parametrize("fields", [dict(instance=1), dict(entry_size=64), dict(num_entries=100_000),
                                    dict(num_entries=257),  # below the L2 share (256) and the QP1s (2)
                                    dict(page_size_pbl_level=3), dict(page_size_pbl_level=0x70),
                                    dict(page_dir=0x1000)])
def test_backing_store_cfg_validation(fields):
    host = Driver()
    host.hwrm("func_backing_store_qcaps_v2", type=0)
    request = dict(type=0, instance=0, entry_size=704, num_entries=300, page_dir=host.alloc(52),
                   page_size_pbl_level=0) | fields
    host.hwrm("func_backing_store_cfg_v2", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, **request)


def test_a_crashing_handler_becomes_fail_not_an_exception(monkeypatch):
    host = Driver()
    command = host.fw._commands[bnxt.HWRM_FUNC_QCFG]
    monkeypatch.setitem(host.fw._commands, bnxt.HWRM_FUNC_QCFG, command.__class__(
        command.name, command.request, command.response, lambda request: 1 / 0))
    host.hwrm("func_qcfg", expect=bnxt.HWRM_ERR_CODE_FAIL)
    assert host.fw.stats["internal_errors"] == 1 and "division by zero" in host.fw.last_error


def test_identity_and_doorbell_page():
    host = Driver(profile=dataclasses.replace(PROFILES["thor2"], legacy_l2_db_size_kb=126))
    caps = host.hwrm("func_qcaps", fid=0xFFFF)
    assert bytes(caps.mac_address) == MAC and caps.flags & bnxt.FUNC_QCAPS_RESP_FLAGS_ROCE_V2_SUPPORTED
    assert caps.flags_ext & bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_REQUIRED
    assert host.hwrm("func_qcfg", fid=0xFFFF).legacy_l2_db_size_kb == 126 and host.fw.roce_db_offset == 128 << 10


def test_backing_store_walk_gates_initialize_fw():
    host = Driver()
    configured = host.backing_store(all_done=False)
    kinds = sorted({kind for kind, _ in configured})
    assert kinds == [0, 1, 2, 3, 4, 5, 6, 0xE, 0xF] and len(configured) == len(kinds) + 7  # FP TQM: 8 instances
    assert any(not ctx.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID for ctx in CONTEXT_TYPES.values())
    assert host.fw.objects()["backing_store"] == len(configured) and host.fw.ctx_init_ok
    host.open_rcfw()
    stat = host.hwrm("stat_ctx_alloc", stats_dma_length=176).stat_ctx_id
    host.rcfw("initialize_fw", expect=FAIL, stat_ctx_id=stat)
    assert "ALL_DONE" in host.fw.last_error
    host.rcfw("create_cq", expect=FAIL)  # nothing but queries before INITIALIZE_FW
    host.backing_store()
    host.rcfw("initialize_fw", expect=INVALID_PARAMETER, stat_ctx_id=stat + 1)
    host.rcfw("initialize_fw", stat_ctx_id=stat)


def test_trace_buffers_are_optional_and_accepted():
    """A firmware log buffer (FW_DBG_TRACE) is valid but not needed: bnxt_en configures it only to collect logs."""
    trace = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_SRT_TRACE
    assert CONTEXT_TYPES[trace].flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_FW_DBG_TRACE
    with_trace = Driver()
    assert (trace, 0) in with_trace.backing_store(trace=True) and with_trace.fw.backing_store_missing() is None
    without = Driver()
    assert (trace, 0) not in without.backing_store() and without.fw.backing_store_missing() is None


def test_a_required_type_left_out_keeps_initialize_fw_refused():
    host = Driver()
    host.backing_store(leave_out=frozenset({BS.MRAV}))  # ALL_DONE on the last, TIM
    host.open_rcfw()
    stat = host.hwrm("stat_ctx_alloc", stats_dma_addr=host.alloc(), stats_dma_length=176).stat_ctx_id
    host.rcfw("initialize_fw", expect=FAIL, stat_ctx_id=stat)
    assert host.fw.last_error == "RCFW initialize_fw: backing-store type 0xe instances [0] not configured"


@pytest.mark.parametrize("sizes", [
    {},  # the QP entries: the L2 share (256), the QP1s (2) and 6 more
    {BS.TIM: 256 + 8},  # a timer context for every QP, L2 ones included
    {BS.SP_TQM_RING: 128 + 256 + 2 * 8 + 64},  # the slow-path ring: VNICs, L2 QPs, two per RoCE QP, its minimum
    {BS.FP_TQM_RING: 256 + 8},  # each fast-path ring: every QP
], ids=["qp", "tim", "sp-tqm", "fp-tqm"])
def test_exactly_the_qps_the_backing_store_holds_can_be_created(sizes):
    """8 RoCE QPs backed: the eighth is created, the ninth refused with RESOURCES, and one destroyed makes room."""
    host = Driver()
    host.boot(store=dict(extra_qps=64 if sizes else 6, sizes=sizes))
    assert host.rcfw("query_func").max_qp == 8
    cq = host.create_cq()
    qps = [host.create_qp(cq) for _ in range(8)]
    host.create_qp(cq, expect=bnxt.CREQ_QP_EVENT_STATUS_RESOURCES)
    assert host.fw.last_error == "RCFW create_qp: the backing store holds 8 QP contexts; all are in use"
    host.rcfw("destroy_qp", qp_cid=qps[3])
    assert host.create_qp(cq) == qps[3]


def test_cqs_mrs_statistics_contexts_and_vnics_fit_the_backing_store():
    """Each as many as configured, less the firmware's own share: L2 CQs (256), address handles (MRAV's split 0 as
    the driver sent it), RSS ring tables (VNIC entries past split 0)."""
    host = Driver()
    host.boot(store=dict(extra_qps=2, sizes={BS.MRAV: 3, BS.STAT: 2, BS.VNIC: 1}))  # CQs: 256 + 2 x 2
    cqs = [host.create_cq() for _ in range(4)]
    host.rcfw("create_cq", expect=bnxt.CREQ_QP_EVENT_STATUS_RESOURCES, cq_handle=1, cq_size=64,
              cq_fco_cnq_id=host.nq_id, pg_size_lvl=0, pbl=host.alloc())
    assert "holds 4 CQ contexts" in host.fw.last_error and len(cqs) == 4
    for _ in range(3):
        host.rcfw("allocate_mrw", pd_id=1, mrw_flags=bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR)
    host.rcfw("allocate_mrw", expect=bnxt.CREQ_QP_EVENT_STATUS_RESOURCES, pd_id=1,
              mrw_flags=bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR)
    assert "holds 3 MR contexts" in host.fw.last_error
    host.hwrm("stat_ctx_alloc", stats_dma_addr=host.alloc(), stats_dma_length=176)  # boot() took the first
    host.hwrm("stat_ctx_alloc", expect=bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR, stats_dma_addr=host.alloc(),
              stats_dma_length=176)
    assert host.fw.last_error == "HWRM stat_ctx_alloc: all 2 statistics contexts are allocated"
    host.hwrm("vnic_alloc")
    host.hwrm("vnic_alloc", expect=bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR)
    assert host.fw.last_error == "HWRM vnic_alloc: all 1 VNICs are allocated"


def test_context_init_at_a_byte_offset_is_noted_not_refused():
    host = Driver()
    host.backing_store(init_offset_units=1)  # the seed's mistake: ctx_init_offset used as a byte offset
    assert not host.fw.ctx_init_ok and host.fw.backing_store_done


def test_ring_alloc_and_free():
    host = Driver()
    nq = host.ring(NQ, 64, logical_id=3)
    big = host.ring(NQ, 1024, logical_id=4)  # 4 pages: level 1
    assert isinstance(host.fw.rings[big], NotificationQueue) and len(host.fw.rings[big].pages.pages) == 4
    cmpl = host.ring(L2_CMPL, 64, enables=bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID, nq_ring_id=nq)
    host.hwrm("ring_free", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, ring_type=NQ, ring_id=nq)  # cmpl uses it
    host.hwrm("ring_free", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, ring_type=RX, ring_id=cmpl)  # wrong type
    host.hwrm("ring_free", ring_type=L2_CMPL, ring_id=cmpl)
    host.hwrm("ring_free", ring_type=NQ, ring_id=nq)
    assert host.ring(NQ, 16) == nq  # ids are reused lowest-first
    assert host.fw.objects()["rings"] == 2



@pytest.mark.parametrize("enables", [RX_BUF_SIZE, RX_BUF_SIZE | bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID,
                                     RX_BUF_SIZE | bnxt.RING_ALLOC_REQ_ENABLES_STAT_CTX_ID_VALID])
def test_an_rx_ring_names_its_buffer_size_and_may_name_an_nq(enables):
    """Linux 7.2 names the NQ (bnxt_set_rx_ring_params_p5), older Linux and DPDK do not: firmware takes both."""
    host = Driver()
    nq = host.ring(NQ, 64, logical_id=3)
    host.ring(RX, 64, enables=enables, rx_buf_size=2048, nq_ring_id=nq, stat_ctx_id=0)
    host.hwrm("ring_alloc", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, ring_type=RX, length=64,
              page_tbl_addr=host.alloc(), enables=enables & ~RX_BUF_SIZE, rx_buf_size=2048, nq_ring_id=nq)
    assert "RX_BUF_SIZE_VALID" in host.fw.last_error


@pytest.mark.parametrize("flags, expect", [(PATH_RX | OUTERMOST, 0), (PATH_RX, bnxt.HWRM_ERR_CODE_INVALID_PARAMS),
                                           (OUTERMOST, bnxt.HWRM_ERR_CODE_INVALID_PARAMS)])
def test_the_l2_filter_is_an_rx_filter_on_the_outermost_header(flags, expect):
    host = Driver()
    vnic = host.hwrm("vnic_alloc").vnic_id
    host.hwrm("cfa_l2_filter_alloc", expect=expect, flags=flags, dst_id=vnic, l2_addr=tuple(MAC),
              l2_addr_mask=(0xFF,) * 6, enables=bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_DST_ID)
    assert not expect or "PATH_RX | OUTERMOST" in host.fw.last_error


@pytest.mark.parametrize("profile, tpa_v2, length", [("thor2", True, 176), ("thor-bs-v2", True, 168),
                                                     ("thor2", False, 160), ("thor-bs-v2", False, 160)])
def test_a_statistics_context_is_the_length_of_the_chips_block(profile, tpa_v2, length):
    """VNIC_QCAPS reports TPA v2 (max_aggs_supported) and with it Linux sizes the block by chip
    (bnxt_hwrm_vnic_qcaps): a driver that names another length is refused, one byte either side."""
    host = Driver(profile=dataclasses.replace(PROFILES[profile], tpa_v2=tpa_v2))
    assert bool(host.hwrm("vnic_qcaps").max_aggs_supported) == tpa_v2
    for wrong in (length - 1, length + 1, 176 if length != 176 else 168):
        host.hwrm("stat_ctx_alloc", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, stats_dma_length=wrong)
        assert f"block is {length} bytes" in host.fw.last_error
    host.hwrm("stat_ctx_alloc", stats_dma_length=length, stats_dma_addr=host.alloc())


def test_thor_roce_doorbells_are_at_0x10000_whatever_func_qcfg_says():
    """bnxt_re_set_db_offset: P5 takes BNXT_QPLIB_DBR_PF_DB_OFFSET; a driver that reads FUNC_QCFG's
    legacy_l2_db_size_kb as Thor2's does rings below it, where nothing answers."""
    host = Driver(profile=PROFILES["thor-bs-v2"])
    host.boot()
    assert host.hwrm("func_qcfg", fid=0xFFFF).legacy_l2_db_size_kb == 0 and host.fw.roce_db_offset == 0x10000
    cq = host.create_cq(arm_enable=False)
    host.bar2.doorbell(0, doorbell.arm_enable(cq, 0))  # Thor2's place for this FUNC_QCFG
    host.bar2.doorbell(0xFFF8, doorbell.arm_enable(cq, 0))  # the last doorbell before the page
    assert host.fw.stats["legacy_doorbells"] == 2 and "below the RoCE doorbell page at 0x10000" in host.fw.last_error
    host.doorbell(cq, bnxt.DBC_DBC_TYPE_CQ_ARMALL, 0)
    assert host.fw.stats["cq_doorbells_ignored"] == 1  # never enabled for arming
    host.bar2.doorbell(0x10000, doorbell.arm_enable(cq, 0))
    host.doorbell(cq, bnxt.DBC_DBC_TYPE_CQ_ARMALL, 0)
    assert host.fw.stats["cq_doorbells_ignored"] == 1 and host.fw.stats["legacy_doorbells"] == 2


# -- RCFW channel --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth, level", [(32, 0), (8192, 0), (512, 1), (512, 2)])
def test_a_nine_slot_command_wraps_across_the_cmdq_end(depth, level):
    """Current Linux's CMDQ is 8192 slots in one contiguous 128 KiB area at level 0 (bnxt_qplib_alloc_rcfw_channel);
    older Linux paged it behind a PBL: both are read slot by slot across the end."""
    host = Driver()
    host.boot(cmdq_depth=depth, cmdq_level=level)
    cq = host.create_cq()
    qp = host.create_qp(cq)
    while host.cmdq_producer % depth != depth - 4:
        host.rcfw("query_version")
    host.rcfw("modify_qp", qp_cid=qp, modify_mask=INIT_MASK, network_type_en_sqd_async_notify_new_state=QPState.INIT)
    assert host.cmdq_producer % depth == 5 and host.fw.rcfw.qps[qp].state == QPState.INIT


def latch_cmdq(host: Driver, pbl: int, depth: int) -> None:
    """A new cmdq_init naming a level-0 CMDQ of `depth` slots at `pbl`; the next command restarts both rings."""
    init = CMDQ_INIT.pack(pbl, depth << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT, host.creq_id, 0)
    for offset in range(0, CMDQ_INIT.size, 4):
        host.fw.rcfw.mailbox_write(offset, int.from_bytes(init[offset:offset + 4], "little"))
    host.cmdq, host.cmdq_depth, host.cmdq_producer, host.first = PageList([pbl], contiguous=True), depth, 0, True
    host.creq_consumer = 0
    host.mem.write(host.fw.rings[host.creq_id].pages.address(0), bytes(CREQ_ENTRY.size * host.creq_length))


def test_a_level_0_cmdq_is_one_area_of_the_size_cmdq_init_names_all_in_host_memory():
    """Level 0 names no page size: the whole CMDQ is the area at cmdq_pbl (Linux's one 128 KiB "page"), so all of it
    must be host memory: 4 KiB past the end leaves the channel deaf; ending exactly at the end serves."""
    host = Driver(memory=4 << 20)
    host.boot()
    end, size = BUS_BASE + (4 << 20), 8192 * 16
    latch_cmdq(host, end - size + PAGE, 8192)
    host.post("query_version")
    assert host.run() == 0 and "RCFW cmdq_init" in host.fw.last_error and "outside host memory" in host.fw.last_error
    latch_cmdq(host, end - size, 8192)
    host.rcfw("query_version")


def test_several_commands_per_trigger_are_all_answered_by_cookie(driver):
    cookies = {driver.post("query_version"): bnxt.CMDQ_BASE_OPCODE_QUERY_VERSION,
               driver.post("create_cq", cq_size=16, cq_fco_cnq_id=driver.nq_id, pbl=driver.alloc()):
                   bnxt.CMDQ_BASE_OPCODE_CREATE_CQ,
               driver.post("query_func"): bnxt.CMDQ_BASE_OPCODE_QUERY_FUNC}
    assert driver.run() == 3
    answers = {cookie: (event, status)
               for _, status, cookie, _, event in map(CREQ_COMMAND_EVENT.unpack, driver.drain())}
    assert answers == {cookie: (opcode, SUCCESS) for cookie, opcode in cookies.items()}


def test_creq_phase_flips_on_the_second_lap():
    host = Driver()
    host.boot(creq_length=8)
    seen = []
    for _ in range(12):
        count = host.creq_consumer
        host.post("query_version")
        host.run()
        (entry,) = host.drain()
        seen.append((count, entry[CREQ_ENTRY.valid_offset] & CREQ_ENTRY.valid_bit))
    assert all(bit == phase(count, 8) for count, bit in seen) and {bit for _, bit in seen} == {0, 1}


def test_full_creq_waits_for_credit_and_arming_fires_once():
    host = Driver()
    host.boot(creq_length=4)
    rcfw, interrupts = host.fw.rcfw, host.fw.interrupts
    base = host.creq_consumer  # CREQ slots used during boot
    for _ in range(5):
        host.post("query_version")
    rcfw.trigger()
    entries = [rcfw.execute(rcfw.next_command()) for _ in range(5)]
    interrupts.clear()
    assert [rcfw.post_creq(entry) for entry in entries[:4]] == [True] * 4 and not rcfw.post_creq(entries[4])
    assert interrupts == [1]  # armed: the first post fired and disarmed
    host.doorbell(host.creq_id, bnxt.DBC_DBC_TYPE_NQ, *position(base + 1, 4))  # one credit back
    assert rcfw.post_creq(entries[4]) and not rcfw.post_creq(entries[4]) and interrupts == [1]
    host.doorbell(host.creq_id, bnxt.DBC_DBC_TYPE_NQ_ARM, *position(base + 1, 4))
    assert interrupts == [1, 1]  # re-armed with entries still unread: fires at once, no lost wake-up


def test_unknown_and_unemulated_opcodes_are_answered(driver):
    cookie = driver.post("query_version", opcode=0x77)
    driver.run()
    (entry,) = driver.drain()
    _, status, answered, _, event = CREQ_COMMAND_EVENT.unpack(entry)
    assert (status, answered, event) == (bnxt.CREQ_QP_EVENT_STATUS_INVALID_CMD, cookie, 0x77)
    driver.rcfw("create_srq", expect=bnxt.CREQ_QP_EVENT_STATUS_NOT_IMPLEMENTED)


def test_malformed_commands_are_answered_and_the_channel_goes_on(driver):
    bad = driver.post("query_version", cmd_size=0)
    good = driver.post("query_version")
    assert driver.run() == 2
    answers = {cookie: status for _, status, cookie, _, _ in map(CREQ_COMMAND_EVENT.unpack, driver.drain())}
    assert answers == {bad: INVALID_PARAMETER, good: SUCCESS}


def write_creq_ring_id(rcfw, ring_id: int) -> None:
    """Rewrite cmdq_init.creq_ring_id in the mailbox, with the one dword write a driver would make."""
    pbl, size_level, _, producer = CMDQ_INIT.unpack(rcfw.mailbox)
    image, offset = CMDQ_INIT.pack(pbl, size_level, ring_id, producer), bnxt.cmdq_init.creq_ring_id.offset & ~3
    rcfw.mailbox_write(offset, int.from_bytes(image[offset:offset + 4], "little"))


def test_a_cmdq_init_naming_no_nq_ring_leaves_the_channel_deaf(driver):
    rcfw = driver.fw.rcfw
    write_creq_ring_id(rcfw, 0x77)
    driver.first = True
    driver.post("query_version")
    assert driver.run() == 0 and "creq_ring_id 119" in driver.fw.last_error
    write_creq_ring_id(rcfw, driver.creq_id)
    driver.cmdq_producer, driver.creq_consumer, driver.first = 0, 0, True  # the driver starts its rings over
    driver.mem.write(driver.fw.rings[driver.creq_id].pages.address(0), bytes(CREQ_ENTRY.size * driver.creq_length))
    driver.rcfw("query_version")


def test_injected_errors_fail_the_next_commands_only(driver):
    driver.fw.inject_error("create_cq", bnxt.CREQ_QP_EVENT_STATUS_RESOURCES)
    driver.fw.inject_error("func_qcfg", bnxt.HWRM_ERR_CODE_BUSY, count=2)
    driver.rcfw("create_cq", expect=bnxt.CREQ_QP_EVENT_STATUS_RESOURCES)
    driver.create_cq()
    driver.hwrm("func_qcfg", expect=bnxt.HWRM_ERR_CODE_BUSY, fid=0xFFFF)
    driver.hwrm("func_qcfg", expect=bnxt.HWRM_ERR_CODE_BUSY, fid=0xFFFF)
    driver.hwrm("func_qcfg", fid=0xFFFF)
    assert driver.fw.objects()["cqs"] == 1 and not driver.fw.injected_errors


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES)
def test_each_profile_reports_its_chip_and_capabilities_where_linux_reads_them(profile):
    host = Driver(profile=profile)
    ver = host.hwrm("ver_get")
    assert ver.chip_num == profile.chip_num and short_commands_required(ver.dev_caps_cfg) == profile.short_commands
    host.short_commands = profile.short_commands
    flags_ext = host.hwrm("func_qcaps", fid=0xFFFF).flags_ext
    assert bool(flags_ext & bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED) == profile.backing_store_v2
    if not profile.backing_store_v2:  # the v2 commands are not there either
        host.hwrm("func_backing_store_qcaps_v2", expect=bnxt.HWRM_ERR_CODE_CMD_NOT_SUPPORTED, type=0)
        return
    host.boot()
    caps = host.rcfw("query_func")
    assert hw_retx_supported(caps.dev_cap_flags) == profile.hw_retx
    assert host_msn_table(caps.dev_cap_ext_flags_2) == profile.host_msn_table
    areas = {kind: area.entries for (kind, _), area in host.fw.backing_store.items()}
    l2_qps, l2_cqs = CONTEXT_TYPES[0].splits[0], CONTEXT_TYPES[2].splits[0]  # the firmware's own share: not RoCE's
    assert (caps.max_qp, caps.max_cq, caps.max_mr, caps.max_gid) == (areas[0] - l2_qps, areas[2] - l2_cqs,
                                                                     areas[0xE], 256)


@pytest.mark.parametrize("profile", ["thor2", "no-hw-retx"])
def test_initialize_fw_grants_hardware_retransmission_only_where_offered(profile):
    host = Driver(profile=PROFILES[profile])
    host.boot()  # INITIALIZE_FW without the flag: no hardware retransmission
    assert not host.fw.rcfw.hw_retx
    retx = bnxt.CMDQ_INITIALIZE_FW_FLAGS_HW_REQUESTER_RETX_SUPPORTED
    offered = PROFILES[profile].hw_retx
    host.rcfw("initialize_fw", expect=SUCCESS if offered else INVALID_PARAMETER, stat_ctx_id=host.stat_ctx,
              flags=retx)
    assert host.fw.rcfw.hw_retx == offered
    assert offered or "dev_cap_flags do not offer hardware retransmission" in host.fw.last_error
    qp = host.create_qp(host.create_cq())
    assert host.fw.rcfw.qps[qp].hw_retx == offered  # the QP's go-backs read its search table


def test_short_commands_are_read_from_host_memory_and_required_where_asked():
    host = Driver(profile=PROFILES["short-cmd"])
    host.hwrm("ver_get")  # Linux sends VER_GET the long way: it learns about short commands from its answer
    host.hwrm("func_qcaps", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, fid=0xFFFF)
    assert "requires short commands" in host.fw.last_error
    request = bytes(bnxt.hwrm_func_qcaps_input(req_type=bnxt.HWRM_FUNC_QCAPS, cmpl_ring=0xFFFF, seq_id=7,
                                               target_id=0xFFFF, resp_addr=host.response, fid=0xFFFF))
    host.mem.write(host.requests, request)
    window = HWRM_SHORT_REQUEST.pack(bnxt.HWRM_FUNC_QCAPS, SHORT_REQUEST_SIGNATURE, 0, len(request), host.requests)
    addr, data = host.fw.hwrm(window.ljust(bnxt.HWRM_MAX_REQ_LEN, b"\xee"))  # the rest of the window: stale bytes
    caps = bnxt.hwrm_func_qcaps_output.from_buffer_copy(data)
    assert (addr, caps.error_code, caps.seq_id, bytes(caps.mac_address)) == (host.response, 0, 7, MAC)
    assert host.fw.stats["short_commands"] == 1
    nowhere = HWRM_SHORT_REQUEST.pack(bnxt.HWRM_FUNC_QCAPS, SHORT_REQUEST_SIGNATURE, 0, len(request), 1 << 60)
    assert host.fw.hwrm(nowhere.ljust(bnxt.HWRM_MAX_REQ_LEN, b"\0")) is None  # no request there: nothing to answer


# -- the reservation (sim/resources.py; Linux __bnxt_hwrm_reserve_pf_rings, bnxt_hwrm_get_rings) ---------------------
ALLOC_ERROR = bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR
TX, RX_AGG = bnxt.RING_ALLOC_REQ_RING_TYPE_TX, bnxt.RING_ALLOC_REQ_RING_TYPE_RX_AGG


def test_nothing_can_be_allocated_before_func_cfg_reserves_it():
    host = Driver(reserve=False)
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=NQ, length=16)
    assert "0 MSI-X vectors (NQ rings) in use and FUNC_CFG num_msix reserved 0" in host.fw.last_error
    host.hwrm("stat_ctx_alloc", expect=ALLOC_ERROR, stats_dma_length=176)
    assert "FUNC_CFG num_stat_ctxs reserved 0" in host.fw.last_error
    host.hwrm("vnic_alloc", expect=ALLOC_ERROR)
    assert "FUNC_CFG num_vnics reserved 0" in host.fw.last_error
    assert not any(host.fw.objects().values())


def test_each_allocation_counts_against_its_reservation_up_to_the_grant_and_not_one_past():
    host = Driver(reserve=False)
    host.reserve(num_msix=2, num_cmpl_rings=1, num_tx_rings=1, num_rx_rings=2, num_stat_ctxs=1, num_vnics=1)
    qcfg = host.hwrm("func_qcfg", fid=0xFFFF)
    assert (qcfg.alloc_msix, qcfg.alloc_cmpl_rings, qcfg.alloc_tx_rings, qcfg.alloc_rx_rings, qcfg.alloc_stat_ctx,
            qcfg.alloc_vnics, qcfg.alloc_rsscos_ctx) == (2, 1, 1, 2, 1, 1, 0)
    nq = [host.ring(NQ, 16), host.ring(NQ, 16)]
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=NQ, length=16)
    assert "RING_ALLOC type 5: 2 MSI-X vectors (NQ rings) in use and FUNC_CFG num_msix reserved 2" \
        in host.fw.last_error
    on_nq = dict(enables=bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID, nq_ring_id=nq[0])
    cmpl = host.ring(L2_CMPL, 16, **on_nq)
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=L2_CMPL, length=16, **on_nq)
    host.ring(TX, 16, cmpl_ring_id=cmpl)
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=TX, length=16, cmpl_ring_id=cmpl)
    rx_fields = dict(enables=RX_BUF_SIZE, rx_buf_size=2048)
    rx = host.ring(RX, 16, **rx_fields)
    host.ring(RX_AGG, 16, **rx_fields)  # an aggregation ring is an RX ring too
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=RX, length=16, **rx_fields)
    host.hwrm("stat_ctx_alloc", stats_dma_length=176)
    host.hwrm("stat_ctx_alloc", expect=ALLOC_ERROR, stats_dma_length=176)
    host.hwrm("vnic_alloc")
    host.hwrm("vnic_alloc", expect=ALLOC_ERROR)
    host.hwrm("ring_free", ring_type=RX, ring_id=rx)  # freeing gives the reservation back
    host.ring(RX, 16, **rx_fields)
    host.hwrm("func_reset")  # and FUNC_RESET forgets it (Linux reserves again after one)
    assert host.hwrm("func_qcfg", fid=0xFFFF).alloc_msix == 0
    host.hwrm("ring_alloc", expect=ALLOC_ERROR, ring_type=NQ, length=16)


def test_an_nqs_vector_is_one_of_the_msix_vectors_reserved():
    host = Driver(reserve=False)
    host.reserve(num_msix=2)
    host.hwrm("ring_alloc", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, ring_type=NQ, length=16, logical_id=2)
    assert "RING_ALLOC NQ logical_id 2: the vector is not among the 2 FUNC_CFG num_msix reserved" in host.fw.last_error
    host.ring(NQ, 16, logical_id=1)


def test_func_cfg_takes_each_count_with_its_enable_bit_and_refuses_past_the_resource_maxima():
    host = Driver(reserve=False)
    limits = host.hwrm("func_resource_qcaps", fid=0xFFFF)
    caps = host.hwrm("func_qcaps", fid=0xFFFF)
    assert (limits.max_msix, limits.min_msix, limits.max_stat_ctx, limits.max_vnics) == \
        (64, 0, CONTEXT_TYPES[4].max_entries, CONTEXT_TYPES[3].splits[0])  # VNIC entries past split 0: ring tables
    assert (caps.max_cmpl_rings, caps.max_rx_rings, caps.max_stat_ctx) == \
        (limits.max_cmpl_rings, limits.max_rx_rings, limits.max_stat_ctx)
    host.hwrm("func_cfg", fid=0xFFFF, enables=bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX, num_msix=3, num_vnics=9)
    qcfg = host.hwrm("func_qcfg", fid=0xFFFF)
    assert (qcfg.alloc_msix, qcfg.alloc_vnics) == (3, 0)  # no enable bit: not asked for
    host.hwrm("func_cfg", expect=ALLOC_ERROR, fid=0xFFFF, num_msix=4, num_stat_ctxs=limits.max_stat_ctx + 1,
              enables=bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX | bnxt.FUNC_CFG_REQ_ENABLES_NUM_STAT_CTXS)
    assert f"num_stat_ctxs {limits.max_stat_ctx + 1}: this function may reserve at most" in host.fw.last_error
    host.hwrm("func_cfg", fid=0xFFFF, enables=bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX, num_msix=10,
              flags=bnxt.FUNC_CFG_REQ_FLAGS_NQ_ASSETS_TEST)  # a test reserves nothing
    assert host.hwrm("func_qcfg", fid=0xFFFF).alloc_msix == 3  # the refused request changed nothing either


@pytest.mark.parametrize("profile", ["thor2", "short-cmd"])
def test_func_cfg_is_taken_cut_to_the_window_and_whole_in_the_short_format(profile):
    """160 bytes: in the short format where max_ext_req_len allows it, else cut to 128 bytes in the window (Linux
    bnxt_hwrm_func_cfg_short_req_init, __hwrm_send); every field a driver sets lies below byte 86."""
    firmware = PROFILES[profile]
    assert ctypes.sizeof(bnxt.hwrm_func_cfg_input) == 160 and bnxt.hwrm_func_cfg_input.options.offset < 86
    host = Driver(reserve=False, profile=firmware)
    ver = host.hwrm("ver_get")
    host.short_commands = short_commands_required(ver.dev_caps_cfg)
    assert ver.max_ext_req_len == firmware.max_ext_req_len == (256 if firmware.short_commands else 128)
    host.reserve(num_msix=1)
    assert host.fw.reservation.granted["num_msix"] == 1 and host.fw.stats["short_commands"] == host.short_commands
    request = bytes(bnxt.hwrm_func_cfg_input(req_type=bnxt.HWRM_FUNC_CFG, cmpl_ring=0xFFFF, resp_addr=host.response,
                                             fid=0xFFFF))
    host.mem.write(host.requests, request)
    window = HWRM_SHORT_REQUEST.pack(bnxt.HWRM_FUNC_CFG, SHORT_REQUEST_SIGNATURE, 0, len(request), host.requests)
    answered = host.fw.hwrm(window.ljust(bnxt.HWRM_MAX_REQ_LEN, b"\0"))
    assert (answered is not None) == (len(request) <= firmware.max_ext_req_len)  # longer than it takes: unanswered


def test_add_gid_stores_the_plain_gid_and_mac(driver):
    gid = driver.fw.rcfw.gids[driver.gid_index]
    assert (gid.gid, gid.src_mac) == (GID, MAC)
    second = driver.rcfw("add_gid", gid=(1, 2, 3, 4)).xid
    assert second != driver.gid_index
    driver.rcfw("delete_gid", gid_index=second)
    driver.rcfw("delete_gid", expect=INVALID_PARAMETER, gid_index=second)


# -- QPs, CQs, MRs -------------------------------------------------------------------------------------------------
def test_qp_state_machine(driver):
    cq = driver.create_cq()
    qp = driver.create_qp(cq)
    modify = dict(qp_cid=qp, modify_mask=bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE)
    driver.rcfw("modify_qp", expect=INVALID_PARAMETER, network_type_en_sqd_async_notify_new_state=3, **modify)
    driver.rcfw("modify_qp", network_type_en_sqd_async_notify_new_state=1, **modify)
    driver.rcfw("modify_qp", expect=INVALID_PARAMETER, network_type_en_sqd_async_notify_new_state=2, **modify)
    driver.rcfw("modify_qp", expect=INVALID_PARAMETER, network_type_en_sqd_async_notify_new_state=9, **modify)
    driver.connect(qp, peer=qp)
    state = driver.fw.rcfw.qps[qp]
    assert (state.state, state.dest_qp_id, state.dgid, state.dest_mac, state.path_mtu) == (
        QPState.RTS, qp, GID, MAC, 4096)
    assert (state.sq_psn, state.rq_psn, state.timeout, state.access) == (0x654321, 0x123456, 14, 7)
    assert state.network_type == bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_ROCEV2_IPV4
    query = driver.rcfw("query_qp", qp_cid=qp)
    assert (query.en_sqd_async_notify_state, query.dest_qp_id, bytes(query.dgid), bytes(query.dest_mac)) == (
        QPState.RTS, qp, GID, MAC)
    assert query.path_mtu_dest_vlan_id & 0xF000 == bnxt.CREQ_QUERY_QP_RESP_SB_PATH_MTU_MTU_4096
    driver.rcfw("modify_qp", network_type_en_sqd_async_notify_new_state=6, **modify)  # any -> ERR
    driver.rcfw("modify_qp", expect=INVALID_PARAMETER, network_type_en_sqd_async_notify_new_state=3, **modify)
    driver.rcfw("modify_qp", network_type_en_sqd_async_notify_new_state=0, **modify)  # any -> RESET
    driver.rcfw("modify_qp", expect=INVALID_PARAMETER, qp_cid=qp + 100, modify_mask=0)


def test_create_qp_validates_its_queues_and_cqs(driver):
    cq = driver.create_cq()
    driver.rcfw("create_qp", expect=INVALID_PARAMETER, type=bnxt.CMDQ_CREATE_QP_TYPE_RC, sq_size=16, scq_cid=cq,
                rcq_cid=cq + 1, sq_pbl=driver.alloc())
    driver.rcfw("create_qp", expect=INVALID_PARAMETER, type=3, sq_size=16, scq_cid=cq, rcq_cid=cq,
                sq_pbl=driver.alloc())
    driver.rcfw("create_qp", expect=INVALID_PARAMETER, type=bnxt.CMDQ_CREATE_QP_TYPE_RC, sq_size=16, scq_cid=cq,
                rcq_cid=cq, sq_pbl=0x1000)  # the SQ is not in host memory
    gsi = driver.rcfw("create_qp", type=bnxt.CMDQ_CREATE_QP_TYPE_GSI, sq_size=16, scq_cid=cq, rcq_cid=cq,
                      sq_fwo_sq_sge=6, sq_pbl=driver.alloc()).xid
    assert gsi == 1 and driver.create_qp(cq) == 2
    assert driver.fw.rcfw.qps[2].variable_wqe and len(driver.fw.rcfw.qps[2].sq.pages) == 2  # ring + MSN area


def test_cq_in_use_cannot_be_destroyed_and_everything_frees_to_zero(driver):
    cq = driver.create_cq()
    qp = driver.create_qp(cq)
    mr = driver.rcfw("allocate_mrw", pd_id=1).xid
    driver.rcfw("destroy_cq", expect=INVALID_PARAMETER, cq_cid=cq)
    driver.rcfw("destroy_qp", qp_cid=qp)
    assert driver.rcfw("destroy_cq", cq_cid=cq).xid == cq
    driver.rcfw("deallocate_key", key=mr)
    driver.rcfw("delete_gid", gid_index=driver.gid_index)
    driver.rcfw("deinitialize_fw")
    driver.hwrm("ring_free", ring_type=NQ, ring_id=driver.nq_id)
    driver.hwrm("stat_ctx_free", stat_ctx_id=driver.stat_ctx)
    driver.hwrm("ring_free", ring_type=NQ, ring_id=driver.creq_id)
    driver.hwrm("func_drv_unrgtr")
    assert not any(driver.fw.objects().values()), driver.fw.objects()


def test_func_reset_forgets_everything(driver):
    driver.create_qp(driver.create_cq())
    driver.hwrm("func_reset")
    assert not any(driver.fw.objects().values()) and driver.fw.rcfw.cmdq is None


@pytest.mark.parametrize("pages, level", [(1, 0), (3, 1), (600, 2)])
def test_memory_regions_at_every_pbl_level(driver, pages, level):
    frames = [driver.alloc()] if level == 0 else driver.scattered(pages)
    size, va = pages * PAGE - 100, 0x7F00_0000_0000
    key = driver.rcfw("register_mr", flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=5, va=va, mr_size=size,
                      access=bnxt.CMDQ_REGISTER_MR_ACCESS_LOCAL_WRITE | bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ,
                      log2_pg_size_lvl=level | 12 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, log2_pbl_pg_size=12,
                      pbl=driver.page_table(frames, level)).xid
    mr = driver.fw.rcfw.mrs[key]
    assert mr.pd == 5 and mr.registered
    assert mr.translate(va + (pages - 1) * PAGE + 8, 10) == [(frames[-1] + 8, 10)]
    if pages > 1:  # a range across a page boundary is split where the pages are not contiguous
        assert mr.translate(va + PAGE - 8, 16, bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ) == [
            (frames[0] + PAGE - 8, 8), (frames[1], 8)]
    with pytest.raises(MemoryProtectionError, match="outside"):
        mr.translate(va + size - 4, 8)
    with pytest.raises(MemoryProtectionError, match="outside"):
        mr.translate(va - 1, 4)
    with pytest.raises(MemoryProtectionError, match="lacks access"):
        mr.translate(va, 4, bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_WRITE)  # REMOTE_READ is 2 for MRs, not 4
    with pytest.raises(MemoryProtectionError, match="PD"):
        mr.translate(va, 4, pd=6)
    driver.rcfw("deregister_mr", lkey=key)
    assert key not in driver.fw.rcfw.mrs


MIB2 = 2 << 20


def test_memory_regions_in_2_mib_pages_translate_by_them_and_their_pbl_must_be_aligned_to_them():
    """REGISTER_MR's log2_pg_size names the size of the pages its PBL lists. Linux lists whole pages of that size,
    each aligned to it, the region starting anywhere in the first (bnxt_qplib_reg_mr over ib_umem_find_best_pgsz's
    blocks): a PBL page or a level-0 base off that alignment is refused."""
    host = Driver(memory=16 << 20)
    host.boot()
    base, va = BUS_BASE + (8 << 20), 0x7F00_0000_0000 + PAGE  # the region starts 4 KiB into its first page
    assert host.next_page <= base

    def register(pbl: int, level: int, expect: int = SUCCESS, size: int = 2 * MIB2 - PAGE - 100):
        return host.rcfw("register_mr", expect=expect, flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=1, va=va,
                         mr_size=size, log2_pg_size_lvl=level | bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_PG_2M,
                         log2_pbl_pg_size=12, pbl=pbl).xid

    mr = host.fw.rcfw.mrs[register(host.page_table([base + (4 << 20), base], 1), 1)]
    assert mr.translate(va, 8) == [(base + (4 << 20) + PAGE, 8)]
    assert mr.translate(va + MIB2 - PAGE - 8, 16) == [(base + (4 << 20) + MIB2 - 8, 8), (base, 8)]
    register(host.page_table([base + (4 << 20) + PAGE, base], 1), 1, INVALID_PARAMETER)
    assert "not aligned to the 0x200000-byte pages" in host.fw.last_error
    register(host.page_table([base + (4 << 20), base + PAGE], 1), 1, INVALID_PARAMETER)
    register(base + PAGE, 0, INVALID_PARAMETER, size=PAGE)
    assert host.fw.rcfw.mrs[register(base, 0, size=PAGE)].translate(va, 8) == [(base + PAGE, 8)]


@pytest.mark.parametrize("shift, expect", [(11, INVALID_PARAMETER), (12, SUCCESS), (30, SUCCESS),
                                           (31, INVALID_PARAMETER)])
def test_a_regions_pages_are_4_kib_to_1_gib(driver, shift, expect):
    """BNXT_RE_PAGE_SIZE_SUPPORTED: Linux names no page size outside 4 KiB..1 GiB."""
    driver.rcfw("register_mr", expect=expect, flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=1, va=BUS_BASE,
                mr_size=PAGE, log2_pg_size_lvl=shift << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, log2_pbl_pg_size=12,
                pbl=BUS_BASE)


@pytest.mark.parametrize("size, expect", [(MIB2 + PAGE, SUCCESS), (MIB2 + MIB2 // 2 + PAGE, INVALID_PARAMETER)])
def test_a_regions_last_page_may_run_past_host_memory_where_the_region_does_not(size, expect):
    """The NIC reaches only the region's bytes (an IOMMU faults nothing else): Linux's last page of a region often
    ends past its memory."""
    host = Driver(memory=15 << 20)
    host.boot()
    pages = [BUS_BASE + (12 << 20), BUS_BASE + (14 << 20)]  # the second ends 1 MiB past host memory
    host.rcfw("register_mr", expect=expect, flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=1, va=0x7F00_0000_0000,
              mr_size=size, log2_pg_size_lvl=1 | bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_PG_2M, log2_pbl_pg_size=12,
              pbl=host.page_table(pages, 1))
    assert expect == SUCCESS or "outside host memory" in host.fw.last_error


def test_two_step_memory_registration(driver):
    key = driver.rcfw("allocate_mrw", pd_id=2, mrw_flags=bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR).xid
    with pytest.raises(MemoryProtectionError, match="no registered memory"):
        driver.fw.rcfw.mrs[key].translate(0, 1)
    page = driver.alloc()
    register = dict(key=key, va=page, mr_size=PAGE, log2_pg_size_lvl=0x30, pbl=page)
    driver.rcfw("register_mr", **register)
    driver.rcfw("register_mr", expect=INVALID_PARAMETER, **register)  # already registered
    assert driver.fw.rcfw.mrs[key].translate(page + 16, 16) == [(page + 16, 16)]
    driver.rcfw("deregister_mr", lkey=key)
    assert not driver.fw.rcfw.mrs[key].registered  # the key stays until DEALLOCATE_KEY
    driver.rcfw("deallocate_key", key=key)
    driver.rcfw("deallocate_key", expect=INVALID_PARAMETER, key=key)



@pytest.mark.parametrize("sq_sge, rq_sge, expect", [(6, 6, SUCCESS), (5, 6, INVALID_PARAMETER),
                                                    (7, 6, INVALID_PARAMETER), (6, 5, INVALID_PARAMETER),
                                                    (6, 7, INVALID_PARAMETER)])
def test_a_static_qps_wqes_are_128_bytes(driver, sq_sge, rq_sge, expect):
    """Static WQEs (no VARIABLE_SIZED_WQE_ENABLED) are 128 bytes, 6 SGEs, in the SQ and in the RQ
    (bnxt_re_setup_swqe_size, bnxt_re_setup_rwqe_size, BNXT_STATIC_MAX_SGE); variable ones take any count."""
    cq = driver.create_cq()
    driver.rcfw("create_qp", expect=expect, type=bnxt.CMDQ_CREATE_QP_TYPE_RC, sq_size=16, sq_fwo_sq_sge=sq_sge,
                sq_pbl=driver.alloc(4), rq_size=8, rq_fwo_rq_sge=rq_sge, rq_pbl=driver.alloc(), scq_cid=cq, rcq_cid=cq)
    assert expect == SUCCESS or "static WQEs are 128 bytes, 6 SGEs" in driver.fw.last_error
    driver.create_qp(cq)  # variable WQEs of 2 SGEs


def test_without_mr_register_alloc_the_key_comes_from_allocate_mrw():
    """Thor firmware lacks MR_REGISTER_ALLOC: REGISTER_MR may not allocate (ALLOC_MR), it registers a key
    ALLOCATE_MRW made (bnxt_re_reg_user_mr); DEALLOCATE_KEY frees a registered MR (bnxt_re_dereg_mr)."""
    host = Driver(profile=PROFILES["thor-bs-v2"])
    host.boot()
    assert not host.rcfw("query_func").dev_cap_flags & bnxt.CREQ_QUERY_FUNC_RESP_SB_MR_REGISTER_ALLOC
    page = host.alloc()
    register = dict(va=page, mr_size=PAGE, log2_pg_size_lvl=12 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, pbl=page)
    host.rcfw("register_mr", expect=INVALID_PARAMETER, flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=0, **register)
    assert "MR_REGISTER_ALLOC" in host.fw.last_error and not host.fw.rcfw.mrs
    host.rcfw("register_mr", expect=INVALID_PARAMETER, key=0x100, **register)  # no key allocated
    key = host.rcfw("allocate_mrw", pd_id=0, mrw_flags=bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR).xid
    assert host.rcfw("register_mr", key=key, **register).xid == key and host.fw.rcfw.mrs[key].registered
    host.rcfw("deallocate_key", key=key)
    assert not host.fw.rcfw.mrs


def test_completion_queue_post_toggle_full_and_notification(driver):
    cq_id = driver.create_cq(size=4, handle=0x1122334455667788)
    cq: CompletionQueue = driver.fw.rcfw.cqs[cq_id]
    cqe = bytes(bnxt.cq_req(qp_handle=7, sq_cons_idx=3, cqe_type_toggle=bnxt.CQ_BASE_CQE_TYPE_REQ))
    toggles = []
    for lap in range(3):
        assert all(cq.post(cqe) for _ in range(4)) and not cq.post(cqe)
        toggles.append({driver.mem.read(cq.pages.address(i * CQ_ENTRY.size), CQ_ENTRY.size)[CQ_ENTRY.valid_offset]
                        & CQ_ENTRY.valid_bit for i in range(4)})
        driver.doorbell(cq_id, bnxt.DBC_DBC_TYPE_CQ, *position(4 * (lap + 1), 4))
    assert toggles == [{1}, {0}, {1}]
    interrupts = driver.fw.interrupts
    interrupts.clear()
    driver.doorbell(driver.nq_id, bnxt.DBC_DBC_TYPE_NQ_ARM, 0)
    driver.doorbell(cq_id, bnxt.DBC_DBC_TYPE_CQ_ARMALL, 0, 1)
    assert cq.post(cqe) and interrupts == [2]
    note = bnxt.nq_cn.from_buffer_copy(driver.mem.read(driver.fw.rings[driver.nq_id].pages.address(0), NQ_ENTRY.size))
    assert note.type & bnxt.NQ_CN_TYPE_MASK == bnxt.NQ_CN_TYPE_CQ_NOTIFICATION and note.v & bnxt.NQ_CN_V
    assert notification_fields(note.type, note.cq_handle_low, note.cq_handle_high)[2] == 0x1122334455667788
    assert cq.post(cqe) and interrupts == [2]  # disarmed until the next CQ_ARMENA and CQ_ARMALL
    assert driver.rcfw("destroy_cq", cq_cid=cq_id).total_cnq_events == 1


def test_a_cq_arm_counts_only_after_cq_armena_with_the_last_notifications_toggle(driver):
    """Linux rings CQ_ARMENA after CREATE_CQ, and again with its toggle after each notification (bnxt_qplib_create_cq,
    bnxt_qplib_service_nq): the emulator ignores an arm that no CQ_ARMENA enabled, and counts it."""
    cq_id = driver.create_cq(arm_enable=False)
    cq: CompletionQueue = driver.fw.rcfw.cqs[cq_id]
    cqe = bytes(bnxt.cq_req(qp_handle=7, sq_cons_idx=3, cqe_type_toggle=bnxt.CQ_BASE_CQE_TYPE_REQ))
    ARMENA, ARMALL = bnxt.DBC_DBC_TYPE_CQ_ARMENA, bnxt.DBC_DBC_TYPE_CQ_ARMALL
    stats = driver.fw.stats
    driver.doorbell(cq_id, ARMALL, 0)
    assert cq.post(cqe) and cq.notifications == 0 and stats["cq_doorbells_ignored"] == 1  # never enabled
    driver.doorbell(cq_id, ARMENA, 0, toggle=0)
    driver.doorbell(cq_id, ARMALL, 0)  # a CQE is waiting: it notifies at once
    assert (cq.notifications, cq.toggle, stats["cq_doorbells_ignored"]) == (1, 1, 1)
    driver.doorbell(cq_id, ARMALL, *position(1, cq.size))
    assert cq.post(cqe) and cq.notifications == 1 and stats["cq_doorbells_ignored"] == 2  # the notification used it
    driver.doorbell(cq_id, ARMENA, 0, toggle=0)  # the toggle before the last notification's
    driver.doorbell(cq_id, ARMALL, *position(1, cq.size))
    assert cq.notifications == 1 and stats["cq_doorbells_ignored"] == 4
    driver.doorbell(cq_id, ARMENA, 0, toggle=1)
    driver.doorbell(cq_id, ARMALL, *position(1, cq.size))
    assert (cq.notifications, cq.toggle, stats["cq_doorbells_ignored"]) == (2, 2, 4)


def test_doorbells_are_decoded_and_recorded(driver):
    cq = driver.create_cq()
    qp = driver.create_qp(cq)
    fw, bar2 = driver.fw, driver.bar2
    bar2.doorbell(fw.roce_db_offset, dbc(qp, bnxt.DBC_DBC_TYPE_SQ, 9, 1))
    bar2.doorbell(fw.roce_db_offset, dbc(qp, bnxt.DBC_DBC_TYPE_RQ, 3))
    bar2.doorbell(fw.roce_db_offset, dbc(qp, bnxt.DBC_DBC_TYPE_SQ, 10, valid=False))
    bar2.doorbell(fw.roce_db_offset, dbc(qp, bnxt.DBC_DBC_TYPE_SQ, 11, path=bnxt.DBC_DBC_PATH_L2))
    bar2.doorbell(0x80, dbc(qp, bnxt.DBC_DBC_TYPE_SQ, 12))
    state = fw.rcfw.qps[qp]
    assert (bar2.datapath.sq_rung, bar2.datapath.rq_rung) == ([state], [state])
    assert (state.sq_producer, state.sq_producer_epoch, state.rq_producer) == (9, 1, 3)
    assert (fw.stats["doorbells_without_valid"], fw.stats["l2_doorbells"], fw.stats["legacy_doorbells"]) == (1, 1, 1)


def test_asynchronous_events_wait_for_creq_room(driver):
    driver.fw.interrupts.clear()
    reason = RequesterErrorReason.REQ_RNR_TIMEOUT_RETRY_LIMIT
    assert driver.fw.rcfw.post_event("qp_error", xid=5, reason=reason)
    assert driver.fw.interrupts == [1]
    for _ in range(driver.creq_length - 1):
        driver.fw.rcfw.post_event("function", event=bnxt.CREQ_FUNC_EVENT_EVENT_TX_WQE_ERROR)
    assert not driver.fw.rcfw.post_event("cq_error", xid=9, reason=2)  # full: held back
    first, *rest = driver.drain()
    assert len(driver.drain()) == 1  # the doorbell made room, the held-back event landed
    qp_error = bnxt.creq_qp_error_notification.from_buffer_copy(first)
    assert (qp_error.type, qp_error.event, qp_error.xid, qp_error.req_err_state_reason) == (
        bnxt.CREQ_BASE_TYPE_QP_EVENT, bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION, 5, reason)
    assert {creq_type(e[0]) for e in rest} == {bnxt.CREQ_BASE_TYPE_FUNC_EVENT}
    with pytest.raises(ValueError):
        driver.fw.rcfw.post_event("meltdown")


# -- ring arithmetic -----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 9), steps=st.lists(st.integers(0, 12), min_size=1, max_size=40))
def test_nq_phase_and_credit_over_many_laps(length, steps):
    host = Driver(memory=1 << 16)
    nq = NotificationQueue(1, NQ, host.mem, PageList([host.alloc()]), length, 4, interrupts=[])
    consumed = 0
    for step in steps:
        posted = 0
        while posted < step and nq.post(bytes(NQ_ENTRY.size)):
            count = nq.produced - 1
            entry = host.mem.read(nq.pages.address(slot(count, length) * NQ_ENTRY.size), NQ_ENTRY.size)
            assert NQ_ENTRY.is_new(entry, 0, count, length) and entry[NQ_ENTRY.valid_offset] == phase(count, length)
            posted += 1
        assert nq.pending <= length and (posted == step or nq.pending == length)
        consumed = min(nq.produced, consumed + step // 2)
        nq.consumer_doorbell(*position(consumed, length), arm=None)
        assert nq.consumed == consumed


def test_walk_pbl_levels_and_limits():
    host = Driver(memory=1 << 22)
    pages = host.scattered(3)
    assert walk_pbl(host.mem, 0, pages[0], 2) == [pages[0], pages[0] + PAGE]
    assert walk_pbl(host.mem, 1, host.page_table(pages, 1, queue=True), 3) == pages
    assert walk_pbl(host.mem, 1, host.page_table(pages, 1, queue=True), 2, through_last=True) == pages
    assert walk_pbl(host.mem, 2, host.page_table(pages, 2), 3) == pages
    with pytest.raises(ValueError):
        walk_pbl(host.mem, 3, pages[0], 1)
    with pytest.raises(ValueError):
        walk_pbl(host.mem, 1, pages[0], 1 << 30)


# -- the port's link (sim/phy.py) -----------------------------------------------------------------------------------
AUTONEG = {"port_id": 0, "enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_MODE,
           "auto_mode": bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_SPEED_MASK,
           "flags": bnxt.PORT_PHY_CFG_REQ_FLAGS_RESET_PHY | bnxt.PORT_PHY_CFG_REQ_FLAGS_RESTART_AUTONEG}
IF_UP = bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP
INVALID_PARAMS = bnxt.HWRM_ERR_CODE_INVALID_PARAMS


def registered(host: Driver) -> int:
    """Register `host` for every link event, with an event ring (an NQ named with FUNC_CFG async_event_cr): the
    ring's id."""
    answer = host.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE
                       | bnxt.FUNC_DRV_RGTR_REQ_ENABLES_ASYNC_EVENT_FWD, os_type=bnxt.FUNC_DRV_RGTR_REQ_OS_TYPE_LINUX,
                       async_event_fwd=forwarding(EventId))
    assert answer.flags == bnxt.FUNC_DRV_RGTR_RESP_FLAGS_IF_CHANGE_SUPPORTED  # else Linux never sends IF_CHANGE
    ring_id = host.ring(NQ, 8, logical_id=3)
    host.hwrm("func_cfg", fid=0xFFFF, enables=bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR, async_event_cr=ring_id)
    return ring_id


def link_events(host: Driver, ring_id: int) -> list[bool]:
    """The LINK_STATUS_CHANGE events on the ring so far: up or down."""
    ring = host.fw.rings[ring_id]
    entries = [ASYNC_EVENT.unpack(host.mem.read(ring.pages.address(i * ASYNC_EVENT_ENTRY.size), ASYNC_EVENT_ENTRY.size))
               for i in range(ring.produced)]
    return [bool(data1 & LINK_UP) for _, event_id, _, data1 in entries if event_id == EventId.LINK_STATUS_CHANGE]


def test_the_link_starts_forced_down_and_comes_up_only_after_if_change_up_and_a_phy_reset():
    """As bnxt_en's unbind leaves it; Linux's open: FUNC_DRV_IF_CHANGE(UP), then PORT_PHY_CFG with RESET_PHY
    (bnxt_update_phy_setting); the link trains for the PHY's delay, then LINK_STATUS_CHANGE says it is up."""
    host = Driver()
    phy, port = host.fw.phy, host.fw.port
    assert host.hwrm("port_phy_qcfg", port_id=0).link == bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LINK and not port.up
    host.hwrm("func_drv_if_change", expect=INVALID_PARAMS, flags=IF_UP)
    assert "FUNC_DRV_RGTR comes first" in host.fw.last_error
    events = registered(host)
    host.hwrm("port_phy_cfg", **AUTONEG)  # taken, but no IF_CHANGE(UP) yet
    assert "before FUNC_DRV_IF_CHANGE(UP)" in host.fw.last_error and phy.due is None
    host.hwrm("func_drv_if_change", flags=IF_UP)
    host.hwrm("port_phy_cfg", **{**AUTONEG, "flags": bnxt.PORT_PHY_CFG_REQ_FLAGS_RESTART_AUTONEG})  # no RESET_PHY
    assert "without RESET_PHY" in host.fw.last_error and phy.due is None
    errors = host.fw.stats["errors"]
    host.hwrm("port_phy_cfg", **AUTONEG)
    assert host.fw.stats["errors"] == errors and phy.due == 0.0  # training: the shell times it at its next step
    phy.tick(10.0)
    assert phy.due == 10.0 + phy.delay
    phy.tick(10.0 + phy.delay * 0.999)  # not yet
    assert not port.up and link_events(host, events) == []
    phy.tick(10.0 + phy.delay)
    answer = host.hwrm("port_phy_qcfg", port_id=0)
    assert (answer.link, answer.link_speed) == (bnxt.PORT_PHY_QCFG_RESP_LINK_LINK,
                                                bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_400GB)
    assert port.up and phy.due is None and link_events(host, events) == [True]


def test_what_takes_the_link_down_and_what_leaves_it_up():
    """Only PORT_PHY_CFG takes it down (FORCE_LINK_DWN, bnxt_hwrm_shutdown_link; a PHY reset while it retrains):
    IF_CHANGE(down), FUNC_DRV_UNRGTR and FUNC_RESET leave the port up for the next driver. Unregistering with the
    interface still up skipped IF_CHANGE(down): noted."""
    host = Driver()
    events = registered(host)
    host.link_up()
    host.hwrm("func_drv_unrgtr")
    assert "the interface is still up" in host.fw.last_error and host.fw.port.up
    events = registered(host)
    host.hwrm("func_drv_if_change", flags=IF_UP)
    host.hwrm("func_drv_if_change", flags=0)
    errors = host.fw.stats["errors"]
    host.hwrm("func_drv_unrgtr")
    host.hwrm("func_reset")
    assert host.fw.stats["errors"] == errors and host.fw.port.up and not host.fw.phy.interface_up
    events = registered(host)
    host.hwrm("func_drv_if_change", flags=IF_UP)
    host.hwrm("port_phy_cfg", **AUTONEG)  # a PHY reset: the link drops and trains again
    assert not host.fw.port.up and link_events(host, events) == [False]
    host.hwrm("port_phy_cfg", port_id=0, flags=bnxt.PORT_PHY_CFG_REQ_FLAGS_FORCE_LINK_DWN)  # cancels the training
    host.fw.phy.tick(0.0)
    host.fw.phy.tick(1.0)
    assert not host.fw.port.up and host.fw.phy.due is None
    host.fw.post_event("link_up")  # a cable plugged in does not lift the force
    assert not host.fw.port.up and link_events(host, events) == [False, False]
    packets = [Packet(Op.RDMA_WRITE_ONLY, 1, 0, payload=bytes(64))]
    assert host.fw.port.carried(packets) == [] and host.fw.stats["dropped_link_down"] == 1


@pytest.mark.parametrize("profile,qcaps,good,bad", [
    ("thor2", {"flags2": bnxt.PORT_PHY_QCAPS_RESP_FLAGS2_SPEEDS2_SUPPORTED},
     [({"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2,
        "force_link_speeds2": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEEDS2_200GB_PAM4_56}, 200_000),
      ({"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2,
        "force_link_speeds2": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEEDS2_400GB_PAM4_112}, 400_000)],
     [{"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_PAM4_LINK_SPEED,
       "force_pam4_link_speed": bnxt.PORT_PHY_CFG_REQ_FORCE_PAM4_LINK_SPEED_200GB},  # Thor's field
      {"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2,
       "force_link_speeds2": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEEDS2_800GB_PAM4_112},  # a speed it lacks
      {"force_link_speeds2": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEEDS2_200GB_PAM4_56}]),  # without its enable
    ("thor", {"flags2": 0},
     [({"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_PAM4_LINK_SPEED,
        "force_pam4_link_speed": bnxt.PORT_PHY_CFG_REQ_FORCE_PAM4_LINK_SPEED_200GB}, 200_000),
      ({"force_link_speed": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEED_100GB}, 100_000)],  # NRZ: no enable bit
     [{"enables": bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2,
       "force_link_speeds2": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEEDS2_100GB},  # Thor2's field
      {"force_link_speed": bnxt.PORT_PHY_CFG_REQ_FORCE_LINK_SPEED_50GB}]),  # an NRZ speed it lacks
])
def test_each_phy_takes_its_own_generations_speeds(profile, qcaps, good, bad):
    """Thor2's PHY takes the SPEEDS2 fields (PORT_PHY_QCAPS flags2 SPEEDS2_SUPPORTED, bnxt_hwrm_set_link_common),
    Thor's the NRZ and PAM4 ones; a forced speed comes up at that speed."""
    host = Driver(profile=PROFILES[profile])
    registered(host)
    host.hwrm("func_drv_if_change", flags=IF_UP)
    assert host.hwrm("port_phy_qcaps", port_id=0).flags2 == qcaps["flags2"]
    force = bnxt.PORT_PHY_CFG_REQ_FLAGS_FORCE | bnxt.PORT_PHY_CFG_REQ_FLAGS_RESET_PHY
    for fields, mbps in good:
        host.hwrm("port_phy_cfg", port_id=0, flags=force, **fields)
        host.fw.phy.tick(0.0)
        host.fw.phy.tick(1.0)
        answer = host.hwrm("port_phy_qcfg", port_id=0)
        assert LINK_SPEED_MBPS[answer.link_speed] == mbps and answer.auto_mode == 0
    for fields in bad:
        host.hwrm("port_phy_cfg", expect=INVALID_PARAMS, port_id=0, flags=force, **fields)
    host.hwrm("port_phy_cfg", expect=INVALID_PARAMS, **{**AUTONEG, "flags": AUTONEG["flags"] | force})
    assert "FORCE and RESTART_AUTONEG" in host.fw.last_error
    host.hwrm("port_phy_cfg", **AUTONEG)  # back to autoneg over every speed: the fastest wins
    host.fw.phy.tick(0.0)
    host.fw.phy.tick(1.0)
    assert LINK_SPEED_MBPS[host.hwrm("port_phy_qcfg", port_id=0).link_speed] == (400_000 if profile == "thor2"
                                                                                 else 200_000)

