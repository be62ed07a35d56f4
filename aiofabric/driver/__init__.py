"""The driver of one BNXT function: the device's life (`device`: boot, events, loss, close), its two command channels
to the firmware (`hwrm_channel` for the NIC, `rcfw_channel` for RoCE), the commands' encoding (`commands`), the
rings both use (`rings`), interrupts, firmware events, liveness and the close budget. The verbs objects (aiofabric.verbs)
are built on it; nothing here knows a queue pair."""
