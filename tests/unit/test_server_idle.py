"""The server's idle clock judges the client, not the server: a request the server is still working on (an open_nic
on a loaded host) keeps its client; the clock restarts at the answer."""
import json

import anyio
import pytest

from aiofabric.peer import serve
from aiofabric.peer.policy import Limits, ServerPolicy

pytestmark = [pytest.mark.anyio, pytest.mark.loop_agnostic]
IDLE = 0.3


async def session(monkeypatch, handling: float, then_wait: float) -> tuple[dict, list[dict]]:
    """One ping that the server takes `handling` s to answer, then `then_wait` s of silence, then end of input."""
    async def slow_handle(self, request):
        await anyio.sleep(handling)
        return {"pong": True}
    monkeypatch.setattr(serve.Endpoint, "handle", slow_handle)
    incoming: list[bytes] = [json.dumps({"id": 1, "op": "ping", "args": {}}).encode() + b"\n"]
    answers: list[dict] = []
    answered = anyio.Event()

    async def receive() -> bytes:
        if incoming:
            return incoming.pop()
        await answered.wait()  # the client reads its answer, then is silent for `then_wait` s
        await anyio.sleep(then_wait)
        return b""

    async def send(data: bytes) -> None:
        answers.extend(answer for answer in map(json.loads, data.splitlines()) if "id" in answer)  # not Ready
        if answers:
            answered.set()

    policy = ServerPolicy(limits=Limits(idle=IDLE))
    with anyio.fail_after(20):
        summary = await serve.serve_stream(receive, send, client="test", policy=policy)
    return summary, answers


async def test_a_request_running_past_the_idle_timeout_keeps_its_client(monkeypatch):
    summary, answers = await session(monkeypatch, handling=4 * IDLE, then_wait=IDLE / 2)
    assert summary["outcome"] == "end of input" and summary["error"] is None
    assert [(a["id"], a["ok"]) for a in answers] == [(1, True)]


async def test_the_idle_clock_restarts_at_the_answer_and_still_drops_a_silent_client(monkeypatch):
    summary, answers = await session(monkeypatch, handling=4 * IDLE, then_wait=60)
    assert summary["outcome"] == "idle"
    assert summary["error"] == f"client test sent no request for {IDLE:g} s; dropped it"
    assert [(a["id"], a["ok"]) for a in answers] == [(1, True)]
