"""The BNXT host interface, described once: what the driver writes and the device reads, and back.

Everything here is a hardware fact read off the generated bindings (`aiofabric.autogen.bnxt`, from Linux's headers):
the driver (aiofabric/driver/ and aiofabric/verbs/) encodes with it, the emulated NIC (aiofabric/sim/) decodes with it,
and the tests build their WQEs and read their CQEs with it, so a mistake cannot be shared by two hand-written
copies. It imports only the bindings and the standard library; choices (ring depths, timeouts) stay
with their users.

    layout     `Layout`: a precompiled `struct.Struct` built from a binding's field offsets and sizes; `field_type`
    wqe        SQ WQE headers (RDMA, SEND), the SGE, the RQ WQE header, the MSN and PSN search entries; the SQ's
               geometry and search table (`SqGeometry`)
    cqe        CQEs (requester, RC responder), NQ CQ notifications, CREQ entries; status and error-reason names
    async_event HWRM async event completions, their event data, the FUNC_DRV_RGTR forwarding bitmap
    doorbell   the 64-bit doorbell: `encode` (driver), `decode` (device)
    ring       slot and lap parity of free-running counts, the valid bit of device-written entries (`RingEntry`),
               the counts a doorbell names, the power-of-two depth a ring must have
    verbs      QP states and legal transitions, path-MTU codes and the largest a port's MTU carries, QP and MR
               access bits, 24-bit PSN arithmetic
    firmware   HWRM request/response headers and the short request, the RCFW CMDQ header and its cmdq_init
               mailbox, chip generations, retransmission capabilities, backing-store types (those a driver
               configures), page-size codes, link speed codes, ring entry sizes, page-table entries, the HWRM
               interrupt vector
    names      the bindings' constants by prefix (for status tables)
    pci        the PCI configuration registers both sides of the seam read

The tests check every layout against the bindings, field by field, and shows a moved field is caught.
"""
