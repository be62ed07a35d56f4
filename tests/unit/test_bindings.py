"""Sizes and offsets of the structures the driver and the emulator use, checked by hand against the Linux headers
(include/linux/bnxt/hsi.h, drivers/infiniband/hw/bnxt_re/roce_hsi.h) and the reference notes."""
import ctypes

import pytest

from aiofabric.autogen import bnxt

SIZES = {
    "hwrm_ver_get_input": 24, "hwrm_ver_get_output": 176, "hwrm_func_reset_input": 24, "hwrm_func_qcaps_input": 24,
    "hwrm_func_qcfg_input": 24, "hwrm_func_drv_rgtr_input": 112, "hwrm_func_backing_store_qcaps_v2_output": 56,
    "hwrm_func_backing_store_cfg_v2_input": 64, "hwrm_stat_ctx_alloc_input": 48, "hwrm_ring_alloc_input": 96,
    "hwrm_ring_alloc_output": 16, "hwrm_vnic_cfg_input": 48, "hwrm_cfa_l2_filter_alloc_input": 96,
    "hwrm_port_phy_cfg_input": 64, "hwrm_err_output": 16, "hwrm_cmd_hdr": 16, "hwrm_resp_hdr": 8,
    "cmdq_init": 16, "cmdq_base": 16, "creq_base": 16, "cmdq_initialize_fw": 112, "cmdq_add_gid": 48,
    "cmdq_create_cq": 64, "cmdq_create_qp": 104, "cmdq_modify_qp": 144, "cmdq_register_mr": 56,
    "cmdq_query_version": 16, "creq_qp_event": 16, "cq_base": 32, "cq_req": 32, "cq_res_rc": 32,
    "cq_terminal": 32, "sq_rdma_hdr": 32, "sq_send_hdr": 32, "sq_sge": 16, "rq_wqe_hdr": 32,
    "sq_msn_search": 8, "nq_cn": 16,
}

OFFSETS = [  # (structure, field, byte offset) as given in the reference notes
    ("hwrm_cmd_hdr", "resp_addr", 8), ("hwrm_resp_hdr", "resp_len", 6), ("hwrm_err_output", "valid", 15),
    ("hwrm_ver_get_output", "max_req_win_len", 118), ("hwrm_ver_get_output", "def_req_timeout", 122),
    ("hwrm_func_qcaps_output", "mac_address", 16), ("hwrm_func_qcaps_output", "port_id", 10),
    ("hwrm_func_qcfg_output", "legacy_l2_db_size_kb", 84), ("hwrm_func_qcfg_output", "l2_doorbell_bar_size_kb", 76),
    ("hwrm_func_backing_store_qcaps_v2_output", "entry_size", 10),
    ("hwrm_func_backing_store_qcaps_v2_output", "instance_bit_map", 16),
    ("hwrm_func_backing_store_qcaps_v2_output", "ctx_init_offset", 21),
    ("hwrm_func_backing_store_qcaps_v2_output", "next_valid_type", 32),
    ("hwrm_func_backing_store_qcaps_v2_output", "split_entry_0", 36),
    ("hwrm_stat_ctx_alloc_output", "stat_ctx_id", 8), ("hwrm_ring_alloc_output", "ring_id", 8),
    ("hwrm_cfa_l2_filter_alloc_output", "l2_filter_id", 8),
    ("cmdq_init", "cmdq_size_cmdq_lvl", 8), ("cmdq_init", "creq_ring_id", 10), ("cmdq_init", "prod_idx", 12),
    ("cmdq_base", "cookie", 4), ("cmdq_base", "resp_size", 6), ("cmdq_base", "resp_addr", 8),
    ("creq_base", "v", 8), ("creq_create_qp_resp", "xid", 4), ("creq_qp_event", "event", 9),
    ("cmdq_initialize_fw", "log2_dbr_pg_size", 22), ("cmdq_initialize_fw", "stat_ctx_id", 108),
    ("cmdq_add_gid", "gid", 16), ("cmdq_add_gid", "src_mac", 32), ("cmdq_add_gid", "vlan", 38),
    ("cmdq_create_cq", "cq_handle", 16), ("cmdq_create_cq", "cq_size", 36), ("cmdq_create_cq", "pbl", 40),
    ("cmdq_create_qp", "qp_handle", 16), ("cmdq_create_qp", "type", 28), ("cmdq_create_qp", "sq_size", 36),
    ("cmdq_create_qp", "scq_cid", 48), ("cmdq_create_qp", "sq_pbl", 64), ("cmdq_create_qp", "orrq_addr", 88),
    ("cmdq_modify_qp", "qp_type", 7), ("cmdq_modify_qp", "modify_mask", 16), ("cmdq_modify_qp", "access", 25),
    ("cmdq_modify_qp", "dgid", 32), ("cmdq_modify_qp", "sgid_index", 52), ("cmdq_modify_qp", "dest_mac", 56),
    ("cmdq_modify_qp", "path_mtu_pingpong_push_enable", 63), ("cmdq_modify_qp", "timeout", 64),
    ("cmdq_modify_qp", "rq_psn", 68), ("cmdq_modify_qp", "sq_psn", 72), ("cmdq_modify_qp", "dest_qp_id", 96),
    ("cmdq_register_mr", "access", 17), ("cmdq_register_mr", "key", 20), ("cmdq_register_mr", "va", 32),
    ("cmdq_register_mr", "mr_size", 40),
    ("cq_base", "cqe_type_toggle", 24), ("cq_req", "sq_cons_idx", 8), ("cq_req", "status", 25),
    ("cq_res_rc", "qp_handle", 8), ("cq_res_rc", "flags", 26), ("cq_res_rc", "srq_or_rq_wr_id", 28),
    ("sq_rdma_hdr", "wqe_size", 2), ("sq_rdma_hdr", "length", 8), ("sq_rdma_hdr", "remote_va", 16),
    ("sq_rdma_hdr", "remote_key", 24), ("sq_send_hdr", "q_key", 12), ("sq_sge", "l_key", 8),
    ("rq_wqe_hdr", "wr_id", 8), ("nq_cn", "cq_handle_low", 4), ("nq_cn", "v", 8),
]

CONSTANTS = {
    "HWRM_VER_GET": 0x00, "HWRM_FUNC_RESET": 0x11, "HWRM_FUNC_QCAPS": 0x15, "HWRM_FUNC_QCFG": 0x16,
    "HWRM_FUNC_DRV_RGTR": 0x1D, "HWRM_RING_ALLOC": 0x50, "HWRM_STAT_CTX_ALLOC": 0xB0, "HWRM_VNIC_ALLOC": 0x40,
    "HWRM_CFA_L2_FILTER_ALLOC": 0x90, "HWRM_PORT_PHY_CFG": 0x20, "HWRM_FUNC_BACKING_STORE_QCAPS_V2": 0x1A8,
    "HWRM_FUNC_BACKING_STORE_CFG_V2": 0x1A3, "HWRM_ERR_CODE_CMD_NOT_SUPPORTED": 0xFFFF,
    "BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER": 0x100, "RCFW_COMM_BASE_OFFSET": 0x600, "RCFW_COMM_TRIG_OFFSET": 0x100,
    "RCFW_PF_VF_COMM_PROD_OFFSET": 0xC, "FIRMWARE_FIRST_FLAG": 31, "CMDQ_INIT_CMDQ_SIZE_SFT": 2,
    "CMDQ_BASE_OPCODE_CREATE_QP": 0x01, "CMDQ_BASE_OPCODE_MODIFY_QP": 0x03, "CMDQ_BASE_OPCODE_CREATE_CQ": 0x09,
    "CMDQ_BASE_OPCODE_REGISTER_MR": 0x0F, "CMDQ_BASE_OPCODE_ADD_GID": 0x11, "CMDQ_BASE_OPCODE_INITIALIZE_FW": 0x80,
    "CREQ_BASE_TYPE_QP_EVENT": 0x38, "CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION": 0xC0,
    "DBC_DBC_TYPE_SQ": 0, "DBC_DBC_TYPE_CQ_ARMALL": 6 << 28, "DBC_DBC_TYPE_NQ_ARM": 0xB << 28,
    "DBC_DBC_XID_MASK": 0xFFFFF, "BNXT_QPLIB_DBR_VALID": 1 << 26, "BNXT_QPLIB_DBR_EPOCH_SHIFT": 24,
    "PTU_PTE_VALID": 1, "PTU_PTE_LAST": 2, "PTU_PTE_NEXT_TO_LAST": 4, "CQ_BASE_CQE_TYPE_RES_RC": 0x02,
    "CQ_BASE_CQE_TYPE_TERMINAL": 0x1C, "CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR": 11,
    "CMDQ_MODIFY_QP_ACCESS_REMOTE_READ": 4, "CMDQ_REGISTER_MR_ACCESS_REMOTE_READ": 2,
    "CMDQ_REGISTER_MR_ACCESS_REMOTE_WRITE": 4, "SQ_RDMA_HDR_WQE_TYPE_READ_WQE": 6,
}


@pytest.mark.parametrize("name,size", SIZES.items())
def test_structure_sizes(name, size):
    assert ctypes.sizeof(getattr(bnxt, name)) == size


@pytest.mark.parametrize("struct,field,offset", OFFSETS)
def test_field_offsets(struct, field, offset):
    assert getattr(getattr(bnxt, struct), field).offset == offset


@pytest.mark.parametrize("name,value", CONSTANTS.items())
def test_constants(name, value):
    assert getattr(bnxt, name) == value


def test_generator_reproduces_committed_module(tmp_path):
    """Regenerating from the same headers must give the committed file byte for byte (skipped without headers)."""
    import os

    from aiofabric.autogen import generate

    root = os.environ.get("AIOFABRIC_LINUX_SOURCE", "")
    if not os.path.exists(os.path.join(root, generate.HSI)):
        pytest.skip("set AIOFABRIC_LINUX_SOURCE to an unpacked linux-source tree to check regeneration")
    out = tmp_path / "bnxt.py"
    generate.main(["--linux-source", root, "--output", str(out)])
    assert out.read_text() == open(bnxt.__file__).read()
