"""aiofabric/hw against the bindings: every layout field by field, every layout and the doorbell round-tripped through
ctypes, the ring and PSN arithmetic; and a layout broken on purpose, to show that this check is what catches a
mistake the driver and the emulator would share."""
import ctypes
import random
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.hw import async_event, cqe, doorbell, firmware, ring, verbs, wqe
from aiofabric.hw.layout import Field, Layout

MODULES = (wqe, cqe, firmware, async_event)
LAYOUTS = {f"{module.__name__}.{name}": value for module in MODULES for name, value in vars(module).items()
           if isinstance(value, Layout)}
TOKEN = re.compile(r"(\d*)([xBHIQ])")


def format_fields(layout: struct.Struct) -> list[tuple[int, int]]:
    """(offset, size) of every value-carrying item of a little-endian format, read off the format itself."""
    assert layout.format.startswith("<")
    found, position = [], 0
    for count, code in TOKEN.findall(layout.format[1:]):
        size = int(count or 1) * struct.calcsize("<" + code)
        if code != "x":
            found.append((position, size))
        position += size
    return found


def disagreements(layout: Layout) -> list[str]:
    """Every way `layout` departs from the bindings (empty when it describes them exactly)."""
    problems = []
    if len(format_fields(layout)) != len(layout.fields):
        problems.append(f"format {layout.format!r} packs {len(format_fields(layout))} items, not {len(layout.fields)}")
    for field, (offset, size) in zip(layout.fields, format_fields(layout)):
        described = getattr(field.binding, field.name)
        where = f"{field.binding.__name__}.{field.name}"
        if (offset - field.base, size) != (described.offset, described.size):
            problems.append(f"{where}: format puts it at {offset - field.base} ({size} B), the binding at "
                            f"{described.offset} ({described.size} B)")
        if (field.offset - field.base, field.size) != (described.offset, described.size):
            problems.append(f"{where}: recorded at {field.offset - field.base} ({field.size} B)")
    bases = dict.fromkeys((field.base, field.binding) for field in layout.fields)
    if layout.size != sum(ctypes.sizeof(binding) for _, binding in bases):
        problems.append(f"{layout.size} bytes, the bindings {[ctypes.sizeof(b) for _, b in bases]}")
    return problems + round_trip_disagreements(layout)


def random_values(layout: Layout, rng: random.Random) -> list[int]:
    return [rng.getrandbits(8 * field.size // field.count) for field in layout.fields for _ in range(field.count)]


def round_trip_disagreements(layout: Layout, seed: int = 0) -> list[str]:
    """Pack random values, read them with ctypes; fill ctypes with random bytes, unpack them: both must agree."""
    rng, problems = random.Random(seed), []
    values = random_values(layout, rng)
    packed = layout.pack(*values)
    raw = bytes(rng.getrandbits(8) for _ in range(layout.size))
    unpacked = iter(layout.unpack(raw))
    given_values = iter(values)
    for field in layout.fields:
        wrote = [next(given_values) for _ in range(field.count)]
        read = [next(unpacked) for _ in range(field.count)]
        size = ctypes.sizeof(field.binding)
        linux_read = getattr(field.binding.from_buffer_copy(packed[field.base:field.base + size]), field.name)
        linux_wrote = getattr(field.binding.from_buffer_copy(raw[field.base:field.base + size]), field.name)
        as_list = (lambda v: list(v) if field.count > 1 else [v])
        if as_list(linux_read) != wrote:
            problems.append(f"{field.binding.__name__}.{field.name}: packed {wrote}, Linux's layout reads "
                            f"{as_list(linux_read)}")
        if as_list(linux_wrote) != read:
            problems.append(f"{field.binding.__name__}.{field.name}: Linux's layout holds {as_list(linux_wrote)}, "
                            f"unpacked {read}")
    return problems


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_is_the_bindings_field_by_field(name):
    assert disagreements(LAYOUTS[name]) == []


def test_the_layouts_cover_the_host_interface():
    """The formats both sides exchange on the hot paths, each from its binding."""
    covered = {field.binding.__name__ for layout in LAYOUTS.values() for field in layout.fields}
    assert covered >= {"sq_rdma_hdr", "sq_send_hdr", "sq_sge", "rq_wqe_hdr", "sq_msn_search", "sq_psn_search_ext",
                       "cq_req", "cq_res_rc", "nq_cn", "creq_qp_event", "hwrm_cmd_hdr", "hwrm_resp_hdr",
                       "hwrm_short_input", "cmdq_base", "cmdq_init"}


def test_send_and_rdma_headers_share_what_a_device_reads_first():
    """A device reads every WQE's first slots as sq_rdma_hdr (SQ_RDMA_HEADER_AND_SGE): the fields it uses from a SEND
    must sit where sq_send_hdr has them."""
    for rdma, send in (("wqe_type", "wqe_type"), ("flags", "flags"), ("wqe_size", "wqe_size"),
                       ("imm_data", "inv_key_or_imm_data"), ("length", "length")):
        assert (getattr(bnxt.sq_rdma_hdr, rdma).offset, getattr(bnxt.sq_rdma_hdr, rdma).size) == \
            (getattr(bnxt.sq_send_hdr, send).offset, getattr(bnxt.sq_send_hdr, send).size)
    assert ctypes.sizeof(bnxt.sq_rdma_hdr) == ctypes.sizeof(bnxt.sq_send_hdr) == wqe.SQ_WQE_HEADER_SLOTS * wqe.SQ_SLOT


def test_a_moved_field_is_caught_though_driver_and_emulator_agree():
    """Move sq_rdma_hdr.length 4 bytes on (into the reserved word) in a copy of the layout. A driver packing WQEs with
    it and an emulator unpacking them with it agree with each other, so a driver-against-emulator test passes; both
    disagree with Linux's layout, and only the check against the bindings says so."""
    good = wqe.SQ_RDMA_HEADER
    moved = Layout(good.format.replace("BBB1xII4x", "BBB1xI4xI"), good.fields)
    values = (bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE, bnxt.SQ_SEND_FLAGS_SIGNAL_COMP, 3, 0, 4096, 0x1000, 0x77, 0)
    driver_wrote = moved.pack(*values)
    assert moved.unpack(driver_wrote) == values  # the shared mistake: driver and emulator agree
    assert bnxt.sq_rdma_hdr.from_buffer_copy(driver_wrote).length != 4096  # hardware would read another length
    linux_wqe = bytes(bnxt.sq_rdma_hdr(wqe_type=values[0], flags=values[1], wqe_size=3, length=4096, remote_va=0x1000,
                                       remote_key=0x77))
    assert moved.unpack(linux_wqe)[4] != 4096  # and the emulator misreads what Linux's driver writes
    assert disagreements(good) == []
    problems = disagreements(moved)
    assert any(problem.startswith("sq_rdma_hdr.length: format puts it at 12") for problem in problems), problems


def test_layouts_refuse_fields_out_of_order():
    with pytest.raises(ValueError, match="out of order"):
        Layout.of(bnxt.sq_sge, "l_key", "va_or_pa")


def test_field_records_where_it_came_from():
    joined = wqe.SQ_RDMA_HEADER_AND_SGE
    assert joined.fields[-1] == Field(bnxt.sq_sge, "size", 32, 44, 4, 1)
    assert joined.size == 48 == 3 * wqe.SQ_SLOT


# -- doorbells -------------------------------------------------------------------------------------------------------
KINDS = [value for name, value in vars(bnxt).items() if name.startswith("DBC_DBC_TYPE_")
         and not name.endswith(("_LAST", "_MASK", "_SFT"))]


@given(xid=st.integers(0, bnxt.DBC_DBC_XID_MASK), kind=st.sampled_from(KINDS),
       slot=st.integers(0, bnxt.DBC_DBC_INDEX_MASK), epoch=st.integers(0, 1), toggle=st.integers(0, 3))
def test_doorbell_round_trips_and_is_linux_dbc_dbc(xid, kind, slot, epoch, toggle):
    value = doorbell.encode(xid, kind, slot, epoch, toggle)
    assert doorbell.decode(value) == (xid, kind, slot, epoch, toggle, bnxt.DBC_DBC_PATH_ROCE, True)
    linux = bnxt.dbc_dbc.from_buffer_copy(value.to_bytes(8, "little"))
    assert linux.index & bnxt.DBC_DBC_INDEX_MASK == slot
    assert bool(linux.index & bnxt.DBC_DBC_EPOCH) == epoch
    assert (linux.index & bnxt.DBC_DBC_TOGGLE_MASK) >> bnxt.DBC_DBC_TOGGLE_SFT == toggle
    assert linux.type_path_xid & bnxt.DBC_DBC_XID_MASK == xid
    assert linux.type_path_xid & bnxt.DBC_DBC_TYPE_MASK == kind
    assert linux.type_path_xid & bnxt.DBC_DBC_VALID and linux.type_path_xid & bnxt.DBC_DBC_PATH_MASK == 0


@given(xid=st.integers(0, bnxt.DBC_DBC_XID_MASK), toggle=st.integers(0, 3))
def test_cq_armena_is_linux_armen_db(xid, toggle):
    """bnxt_qplib_armen_db: index always 0, the toggle in the low word, CQ_ARMENA, RoCE path, valid."""
    linux = bnxt.dbc_dbc.from_buffer_copy(doorbell.arm_enable(xid, toggle).to_bytes(8, "little"))
    assert linux.index == toggle << bnxt.DBC_DBC_TOGGLE_SFT
    assert linux.type_path_xid == xid | bnxt.DBC_DBC_TYPE_CQ_ARMENA | bnxt.DBC_DBC_PATH_ROCE | bnxt.DBC_DBC_VALID


def test_doorbell_agrees_with_linux_qplib_shifts():
    """bnxt_re builds doorbells with its own names for the same bits (qplib_res.h)."""
    assert doorbell.EPOCH_SHIFT == bnxt.BNXT_QPLIB_DBR_EPOCH_SHIFT
    assert doorbell.TOGGLE_SHIFT == bnxt.BNXT_QPLIB_DBR_TOGGLE_SHIFT
    assert doorbell.VALID == bnxt.BNXT_QPLIB_DBR_VALID


def test_decode_reports_what_is_wrong_with_a_doorbell():
    value = doorbell.encode(5, bnxt.DBC_DBC_TYPE_SQ, 1)
    *_, valid = doorbell.decode(value & ~(doorbell.VALID << doorbell.HIGH_SHIFT))
    *_, path, _ = doorbell.decode(value | bnxt.DBC_DBC_PATH_L2 << doorbell.HIGH_SHIFT)
    assert (valid, path) == (False, bnxt.DBC_DBC_PATH_L2)


# -- rings -----------------------------------------------------------------------------------------------------------
@given(depth=st.integers(1, 64), count=st.integers(0, 10_000))
def test_position_slot_epoch_and_phase(depth, count):
    assert ring.position(count, depth) == (ring.slot(count, depth), ring.epoch(count, depth))
    assert ring.phase(count, depth) == 1 - ring.epoch(count, depth)
    assert ring.epoch(count + depth, depth) != ring.epoch(count, depth)  # every lap flips it


@pytest.mark.parametrize("entry", [cqe.CQ_ENTRY, cqe.NQ_ENTRY, cqe.CREQ_ENTRY, async_event.ASYNC_EVENT_ENTRY])
def test_published_entries_are_new_on_their_lap_only(entry):
    depth, memory = 4, bytearray(4 * entry.size)
    body = bytes(range(1, entry.size + 1))
    for count in range(3 * depth):
        offset = ring.slot(count, depth) * entry.size
        assert not entry.is_new(memory, offset, count, depth)
        entry.publish(memoryview(memory)[offset:offset + entry.size], body, count, depth)
        assert entry.is_new(memory, offset, count, depth)
        assert not entry.is_new(memory, offset, count + depth, depth)  # one lap on, the same bytes are stale
        valid = entry.valid_offset
        assert memory[offset:offset + valid] == body[:valid]
        assert memory[offset + valid + 1:offset + entry.size] == body[valid + 1:]
        assert memory[offset + valid] & ~entry.valid_bit == body[valid] & ~entry.valid_bit


def test_entry_valid_bits_are_the_bindings():
    assert (cqe.CQ_ENTRY.valid_offset, cqe.CQ_ENTRY.valid_bit) == (bnxt.cq_req.cqe_type_toggle.offset,
                                                                   bnxt.CQ_REQ_TOGGLE)
    assert (cqe.CQ_ENTRY.valid_offset, cqe.CQ_ENTRY.valid_bit) == (bnxt.cq_res_rc.cqe_type_toggle.offset,
                                                                   bnxt.CQ_RES_RC_TOGGLE)
    assert (cqe.NQ_ENTRY.valid_offset, cqe.NQ_ENTRY.valid_bit) == (bnxt.nq_base.info63_v.offset, bnxt.NQ_BASE_V)
    assert (cqe.CREQ_ENTRY.valid_offset, cqe.CREQ_ENTRY.valid_bit) == (bnxt.creq_qp_event.v.offset,
                                                                       bnxt.CREQ_QP_EVENT_V)
    events = async_event.ASYNC_EVENT_ENTRY
    assert (events.size, events.valid_offset, events.valid_bit) == (
        ctypes.sizeof(bnxt.hwrm_async_event_cmpl), bnxt.hwrm_async_event_cmpl.opaque_v.offset, bnxt.ASYNC_EVENT_CMPL_V)
    assert (events.size, events.valid_offset, events.valid_bit) == (  # events travel on an NQ: same size, same bit
        cqe.NQ_ENTRY.size, cqe.NQ_ENTRY.valid_offset, cqe.NQ_ENTRY.valid_bit)


@given(produced=st.integers(0, 1000), length=st.integers(1, 64), behind=st.integers(0, 64))
def test_consumer_from_doorbell_recovers_the_count(produced, length, behind):
    consumed = max(0, produced - min(behind, length))
    named = ring.consumer_from_doorbell(produced, 0, *ring.position(consumed, length), length)
    assert named == consumed
    assert ring.consumer_from_doorbell(produced, produced, *ring.position(consumed, length), length) == produced


@given(consumed=st.integers(0, 1000), length=st.integers(1, 64), ahead=st.integers(0, 64))
def test_producer_from_doorbell_recovers_the_count(consumed, length, ahead):
    produced = consumed + min(ahead, length)
    assert ring.producer_from_doorbell(consumed, *ring.position(produced, length), length) == produced
    assert ring.producer_from_doorbell(consumed, length, 0, length) is None  # an index outside the ring


# -- entries and codes -----------------------------------------------------------------------------------------------
@given(start=st.integers(0, verbs.PSN_MASK), after=st.integers(0, verbs.PSN_MASK), slot=st.integers(0, 0xFFFF))
def test_msn_entry_round_trips_through_linux_masks(start, after, slot):
    entry = wqe.msn_entry(start, after, slot)
    assert wqe.msn_fields(entry) == (start, after, slot)
    assert (entry & bnxt.SQ_MSN_SEARCH_START_PSN_MASK) >> bnxt.SQ_MSN_SEARCH_START_PSN_SFT == start
    assert (entry & bnxt.SQ_MSN_SEARCH_NEXT_PSN_MASK) >> bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT == after
    assert (entry & bnxt.SQ_MSN_SEARCH_START_IDX_MASK) >> bnxt.SQ_MSN_SEARCH_START_IDX_SFT == slot
    linux = bnxt.sq_msn_search.from_buffer_copy(wqe.MSN_ENTRY.pack(entry))
    assert linux.start_idx_next_psn_start_psn == entry


@given(kind=st.integers(0, 0xFF), start=st.integers(0, verbs.PSN_MASK), after=st.integers(0, verbs.PSN_MASK),
       slot=st.integers(0, 0xFFFF))
def test_psn_search_entry_round_trips_through_linux_masks(kind, start, after, slot):
    values = wqe.psn_search_values(kind, start, after, slot)
    assert wqe.psn_search_fields(*values) == (start, after, slot)
    linux = bnxt.sq_psn_search_ext.from_buffer_copy(wqe.PSN_SEARCH_ENTRY.pack(*values))  # bnxt_qplib_fill_psn_search
    assert linux.opcode_start_psn == (start << bnxt.SQ_PSN_SEARCH_START_PSN_SFT & bnxt.SQ_PSN_SEARCH_START_PSN_MASK
                                      | kind << bnxt.SQ_PSN_SEARCH_OPCODE_SFT & bnxt.SQ_PSN_SEARCH_OPCODE_MASK)
    assert linux.flags_next_psn == after << bnxt.SQ_PSN_SEARCH_NEXT_PSN_SFT & bnxt.SQ_PSN_SEARCH_NEXT_PSN_MASK
    assert linux.start_slot_idx == slot


def test_search_tables_are_sized_and_indexed_as_linux_does():
    """msn_tbl_sz: sq_size rounded up to a power of two, halved with variable WQEs; the PSN search table: one entry
    per sq_size unit (a slot, or a static WQE), at the WQE's start."""
    msn = [wqe.SqGeometry(True, slots, True).table_entries for slots in (256, 257, 512, 768)]
    assert msn == [128, 256, 256, 512]
    assert [wqe.SqGeometry(False, wqes, True).table_entries for wqes in (64, 65)] == [64, 128]
    variable, static = wqe.SqGeometry(True, 256, False), wqe.SqGeometry(False, 64, False)
    assert (variable.table_entries, static.table_entries, static.slots) == (256, 64, 64 * wqe.SQ_STATIC_WQE_SLOTS)
    assert (variable.table_index(7, 93), static.table_index(7, 3 * wqe.SQ_STATIC_WQE_SLOTS)) == (93, 3)
    assert wqe.SqGeometry(True, 256, True).table_index(128 + 5, 93) == 5  # the MSN table: by message, wrapping
    assert static.table_offset == static.slots * wqe.SQ_SLOT and static.table_entry is wqe.PSN_SEARCH_ENTRY
    entry = wqe.msn_entry(10, 12, 93)
    assert wqe.SqGeometry(True, 256, True).entry_fields((entry,)) == (10, 12, 93)


@given(handle=st.integers(0, (1 << 64) - 1), toggle=st.integers(0, 3))
def test_cq_notification_round_trips(handle, toggle):
    entry = cqe.cq_notification(handle, toggle)
    kind, low, _, high = cqe.NQ_CQ_NOTIFICATION.unpack(entry)
    assert cqe.notification_fields(kind, low, high) == (bnxt.NQ_CN_TYPE_CQ_NOTIFICATION, toggle, handle)
    linux = bnxt.nq_cn.from_buffer_copy(entry)
    assert linux.cq_handle_high << 32 | linux.cq_handle_low == handle
    assert linux.type & bnxt.NQ_CN_TYPE_MASK == bnxt.NQ_CN_TYPE_CQ_NOTIFICATION


def test_sq_cons_idx_wraps_with_its_field():
    mask = cqe.SQ_CONS_IDX_MASK
    assert bnxt.cq_req(sq_cons_idx=mask).sq_cons_idx == mask and bnxt.cq_req(sq_cons_idx=mask + 1).sq_cons_idx == 0


def test_cqe_and_creq_types():
    assert cqe.cqe_type(bnxt.CQ_BASE_CQE_TYPE_RES_RC | bnxt.CQ_BASE_TOGGLE) == bnxt.CQ_BASE_CQE_TYPE_RES_RC
    assert cqe.creq_type(bnxt.CREQ_BASE_TYPE_QP_EVENT | 0xC0) == bnxt.CREQ_BASE_TYPE_QP_EVENT


def test_status_and_reason_names():
    assert cqe.SEND_STATUS_NAMES[bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR] == "REMOTE_ACCESS_ERR"
    assert cqe.RECV_STATUS_NAMES[bnxt.CQ_RES_RC_STATUS_WORK_REQUEST_FLUSHED_ERR] == "WORK_REQUEST_FLUSHED_ERR"
    reasons, timeout = cqe.QP_ERROR_REASON_NAMES, cqe.RequesterErrorReason.REQ_TIMEOUT_RETRY_LIMIT
    assert reasons["req_err_state_reason"][timeout] == "REQ_TIMEOUT_RETRY_LIMIT"
    assert reasons["res_err_state_reason"][bnxt.CREQ_QP_ERROR_NOTIFICATION_RES_ERR_STATE_REASON_RES_RX_INVALID_R_KEY] \
        == "RES_RX_INVALID_R_KEY"
    assert firmware.HWRM_ERROR_NAMES[bnxt.HWRM_ERR_CODE_INVALID_PARAMS] == "INVALID_PARAMS"
    assert firmware.RCFW_STATUS_NAMES[bnxt.CREQ_QP_EVENT_STATUS_INVALID_PARAMETER] == "INVALID_PARAMETER"


def test_path_mtu_codes_both_ways():
    assert sorted(verbs.PATH_MTU_CODES) == [256, 512, 1024, 2048, 4096, 8192]
    assert verbs.PATH_MTU_CODES[4096] == bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_4096
    assert all(verbs.PATH_MTU_BYTES[code] == mtu for mtu, code in verbs.PATH_MTU_CODES.items())
    assert verbs.QUERY_QP_PATH_MTU_CODES[1024] == bnxt.CREQ_QUERY_QP_RESP_SB_PATH_MTU_MTU_1024


def test_qp_and_mr_access_orders_differ():
    assert verbs.QPAccess.REMOTE_WRITE == verbs.MRAccess.REMOTE_READ
    assert verbs.QPAccess.REMOTE_READ == verbs.MRAccess.REMOTE_WRITE


def test_qp_state_machine():
    S = verbs.QPState
    assert [s.value for s in S] == list(range(7))
    assert verbs.legal_transition(S.RESET, S.INIT) and not verbs.legal_transition(S.RESET, S.RTS)
    assert all(verbs.legal_transition(s, S.ERR) and verbs.legal_transition(s, S.RESET) for s in S)
    assert not verbs.legal_transition(S.ERR, S.RTS)


def test_path_mtu_for_a_port_is_linux_iboe_get_mtu():
    """iboe_get_mtu takes 96 bytes of headers off the netdev's MTU and picks the largest IB MTU left."""
    assert verbs.ROCE_OVERHEAD == 96
    ports = (351, 352, 576, 1500, 2143, 2144, 4191, 4192, 9000)
    assert [verbs.path_mtu_for_port(mtu) for mtu in ports] == [0, 256, 256, 1024, 1024, 2048, 2048, 4096, 4096]


def test_async_events_and_their_forwarding_are_linux_hwrm_async_event_cmpl_and_func_drv_rgtr():
    entry = bnxt.hwrm_async_event_cmpl.from_buffer_copy(async_event.async_event(
        async_event.EventId.LINK_STATUS_CHANGE, async_event.link_event_data(True, 3), 7))
    assert (entry.type & bnxt.ASYNC_EVENT_CMPL_TYPE_MASK, entry.event_id, entry.event_data1, entry.event_data2) == (
        bnxt.ASYNC_EVENT_CMPL_TYPE_HWRM_ASYNC_EVENT, bnxt.ASYNC_EVENT_CMPL_EVENT_ID_LINK_STATUS_CHANGE, 3 << 4 | 1, 7)
    data1 = async_event.reset_event_data(async_event.ResetReason.FW_EXCEPTION_FATAL)
    assert data1 == 0x200 and async_event.reset_reason(data1) == async_event.ResetReason.FW_EXCEPTION_FATAL
    ids = [async_event.EventId.RESET_NOTIFY, async_event.EventId.LINK_STATUS_CHANGE, 0x4C, 0xFF]
    request = bnxt.hwrm_func_drv_rgtr_input(async_event_fwd=async_event.forwarding(ids))
    bitmap = int.from_bytes(bytes(request)[bnxt.hwrm_func_drv_rgtr_input.async_event_fwd.offset:][:32], "little")
    assert bitmap == sum(1 << i for i in ids)  # bit i of the little-endian 256-bit map, as bnxt_en's __set_bit
    assert [i for i in range(256) if async_event.forwarded(request.async_event_fwd, i)] == sorted(ids)


def test_link_speed_codes_in_mbps():
    speeds = firmware.LINK_SPEED_MBPS
    assert speeds[bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_400GB] == 400_000
    assert speeds[bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_2_5GB] == 2_500
    assert speeds[bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_10MB] == 10  # 0xffff, not 100 Mb/s units


def test_psn_diff_wraps_at_24_bits():
    assert verbs.psn_diff(5, 3) == 2 and verbs.psn_diff(3, 5) == -2
    assert verbs.psn_diff(0, verbs.PSN_MASK) == 1 and verbs.psn_diff(verbs.PSN_MASK, 0) == -1
    assert verbs.psn_diff(0x800000, 0) == -0x800000 and verbs.psn_diff(0x7FFFFF, 0) == 0x7FFFFF


def test_psn_count_is_packets_with_one_for_an_empty_message():
    assert [verbs.psn_count(n, 1024) for n in (0, 1, 1024, 1025, 4096)] == [1, 1, 1, 2, 4]


@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=8))
def test_page_table_entries_are_linux_ptu_pte(entries):
    table = firmware.pack_ptes(entries)
    assert len(table) == len(entries) * firmware.PTE_SIZE == len(entries) * ctypes.sizeof(bnxt.ptu_pde)
    for i, entry in enumerate(entries):
        low, high = bnxt.ptu_pte.from_buffer_copy(table, i * firmware.PTE_SIZE).page_next_to_last_last_valid
        assert low | high << 32 == entry
        assert low & bnxt.PTU_PTE_PAGE_MASK == entry & ~firmware.PTE_FLAGS & 0xFFFFFFFF
    assert firmware.unpack_ptes(table, len(entries)) == tuple(entries)


def test_short_requests_and_capabilities_are_linux_bnxt_en_and_bnxt_re():
    short = bnxt.hwrm_short_input.from_buffer_copy(firmware.HWRM_SHORT_REQUEST.pack(0x10, 0x4321, 0, 96, 1 << 40))
    assert (short.req_type, short.signature, short.size, short.req_addr) == (0x10, 0x4321, 96, 1 << 40)
    assert firmware.SHORT_REQUEST_SIGNATURE == bnxt.SHORT_REQ_SIGNATURE_SHORT_CMD == 0x4321
    supported, required = (bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_SUPPORTED,
                           bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_REQUIRED)
    assert [firmware.short_commands_required(caps) for caps in (0, supported, required, supported | required)] == \
        [False, False, False, True]  # bnxt_hwrm_ver_get: both bits
    retx = bnxt.CREQ_QUERY_FUNC_RESP_SB_HW_REQUESTER_RETX_ENABLED, bnxt.CREQ_QUERY_FUNC_RESP_SB_HW_RESPONDER_RETX_ENABLED
    assert [firmware.hw_retx_supported(flags) for flags in (0, *retx)] == [False, True, True]
    tables = (bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_HOST_PSN_TABLE,
              bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_HOST_MSN_TABLE,
              bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_IQM_MSN_TABLE)
    assert [firmware.host_msn_table(flags | 0x1) for flags in tables] == [False, True, False]
    assert firmware.THOR_CHIPS.isdisjoint(firmware.THOR2_CHIPS) and bnxt.CHIP_NUM_57608 in firmware.THOR2_CHIPS


def test_the_driver_configures_the_context_types_bnxt_en_sizes():
    """QP through TIM (BNXT_CTX_MAX); trace buffers and the rest are left to features that use them."""
    kinds = firmware.CONFIGURED_CONTEXT_TYPES
    assert kinds == {0, 1, 2, 3, 4, 5, 6, 0xE, 0xF} and bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_TX_CK not in kinds
    assert bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_SRT_TRACE in firmware.TRACE_CONTEXT_TYPES
    assert kinds.isdisjoint(firmware.TRACE_CONTEXT_TYPES) and len(firmware.TRACE_CONTEXT_TYPES) >= 10


def test_firmware_tables():
    assert firmware.PAGE_SIZE_CODES[bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_PG_4K >> bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_SFT] == 4096
    assert firmware.PAGE_SIZE_CODES[bnxt.CMDQ_CREATE_CQ_PG_SIZE_PG_2M >> bnxt.CMDQ_CREATE_CQ_PG_SIZE_SFT] == 2 << 20
    assert firmware.RING_ENTRY_SIZES[bnxt.RING_ALLOC_REQ_RING_TYPE_NQ] == cqe.NQ_ENTRY.size
    assert firmware.RING_ENTRY_SIZES[bnxt.RING_ALLOC_REQ_RING_TYPE_ROCE_CMPL] == cqe.CQ_ENTRY.size
    assert firmware.PTE_FLAGS & bnxt.PTU_PTE_VALID and firmware.PTE_FLAGS & bnxt.PTU_PTE_LAST
    assert firmware.CMDQ_INIT.size == ctypes.sizeof(bnxt.cmdq_init) <= bnxt.RCFW_COMM_SIZE
    assert firmware.BackingStoreType.MRAV == bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_TYPE_MRAV
