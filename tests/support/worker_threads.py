"""Outliving the event loop's worker threads without waiting out their real idle time (10 s in anyio's asyncio
backend and in trio): the idle time is cut to IDLE, then the threads that did work are waited for until they have
exited. Trio's exit by themselves; anyio's asyncio backend retires idle ones on a later to_thread call."""
from __future__ import annotations

import threading
import time

import anyio
import anyio._backends._asyncio as anyio_asyncio
import pytest

IDLE = 0.5  # seconds a worker thread may idle before it exits


def shorten_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut the worker threads' idle time to IDLE for this test."""
    monkeypatch.setattr(anyio_asyncio.WorkerThread, "MAX_IDLE_TIME", IDLE)
    try:
        import trio._core._thread_cache as trio_threads
    except ImportError:
        pass
    else:
        monkeypatch.setattr(trio_threads, "IDLE_TIMEOUT", IDLE)


def worker(thread: threading.Thread) -> bool:
    """Whether `thread` is one of an event loop's worker threads (an idle trio one carries its default name)."""
    return isinstance(thread, anyio_asyncio.WorkerThread) or thread.name.startswith("Trio thread ")


async def outlive_worker_threads(bound: float = 30.0) -> int:
    """Wait until every worker thread alive now (trio keeps idle ones across event loops, so some may have served
    an earlier test) has exited but the one a last to_thread call keeps (asyncio reuses the newest idle worker and
    retires the older ones); how many exited. Bounded: a thread still alive at `bound` fails the test."""
    started = [thread for thread in threading.enumerate() if worker(thread)]
    deadline = time.monotonic() + bound
    while True:
        await anyio.sleep(IDLE * 1.2)
        kept = await anyio.to_thread.run_sync(threading.current_thread)
        alive = [thread for thread in started if thread.is_alive() and thread is not kept]
        if not alive:
            return len(started) - (kept in started)
        assert time.monotonic() < deadline, f"worker threads {alive} still alive after {bound} s"
