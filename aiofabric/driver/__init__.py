"""The driver of one BNXT function: the device's life (`device`: boot, loss, close), its two command channels to the
firmware (`hwrm_channel` for the NIC, `rcfw_channel` for RoCE), the commands' encoding (`commands`), the rings both use
(`rings`), the context memory the firmware keeps its objects in (`backing_store`), interrupts, asynchronous events
and who hears of them (`firmware_events`), liveness and the close budget. The verbs objects (aiofabric.verbs) are built
on it; nothing here knows a queue pair."""
import logging

log = logging.getLogger("aiofabric.driver.device")  # the driver's one logger: all it says is about a device
