"""The verbs objects applications use, as libibverbs names them: a NIC (its protection domain and context), completion
queues, queue pairs and memory regions, with the completions they return (`nic`, `queues`, `completions`); the codec
of a send queue's ring (`workqueue`), the task that polls completion queues (`poller`) and what a failure does to a
NIC whose firmware no longer answers (`settle`). Everything above the driver (peer/, sched/, collectives/, tools/)
imports these names from here."""
from .completions import Completion
from .nic import NIC, PCI_ADDRESS, DmaBudget, open_nic
from .queues import (ALL_ACCESS, ATOMIC_ACCESS, Access, CompletionQueue, LocalBuffer, MemoryRegion, QPInfo, QPState,
                     QueuePair, RemoteRegion)
from .settle import PROBE_SECONDS, settle, silence
from ..driver.close_budget import CLOSE_TIMEOUT

__all__ = ["CLOSE_TIMEOUT", "Completion", "NIC", "PCI_ADDRESS", "DmaBudget", "open_nic", "ALL_ACCESS", "ATOMIC_ACCESS",
           "Access", "CompletionQueue", "LocalBuffer", "MemoryRegion", "QPInfo", "QPState", "QueuePair", "RemoteRegion",
           "PROBE_SECONDS", "settle", "silence"]
