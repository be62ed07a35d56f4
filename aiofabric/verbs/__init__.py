"""The verbs objects applications use, as libibverbs names them: a NIC (its protection domain and context; `nic`),
completion queues (`cq`), queue pairs (`qp`: their life, from creation through connect to destruction; `post`:
`QueuePair` and the work requests it posts), memory regions (`mr`), the value types they take (`types`) and the
completions they return (`completions`); the codec of a queue pair's rings (`workqueue`), the task that polls
completion queues (`poller`) and what a failure does to a NIC whose firmware no longer answers (`settle`). Everything
above the driver (peer/, sched/, collectives/, tools/) imports these names from here."""
from .completions import Completion
from .cq import CompletionQueue
from .mr import MemoryRegion
from .nic import NIC, PCI_ADDRESS, DmaBudget, open_nic
from .post import QueuePair
from .settle import PROBE_SECONDS, settle, silence
from .types import ALL_ACCESS, ATOMIC_ACCESS, Access, LocalBuffer, QPInfo, QPState, RemoteRegion
from ..driver.close_budget import CLOSE_TIMEOUT

__all__ = ["CLOSE_TIMEOUT", "Completion", "NIC", "PCI_ADDRESS", "DmaBudget", "open_nic", "ALL_ACCESS", "ATOMIC_ACCESS",
           "Access", "CompletionQueue", "LocalBuffer", "MemoryRegion", "QPInfo", "QPState", "QueuePair", "RemoteRegion",
           "PROBE_SECONDS", "settle", "silence"]
