"""The scheduler: compiled batches of kernel, copy and RDMA calls over many in-order queues (design.md §4)."""
