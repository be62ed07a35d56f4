"""A rank that fails says so: the other ranks of a `join`ed job fail at once naming it and its reason (not at their
collective's timeout, blaming a neighbour), and the failing rank's exception leaves `join` as itself. The
rendezvous cannot be held hostage by connections that never claim a rank, and a job that cannot start names why."""
import contextlib
import re
import sys

import anyio
import anyio.abc
import anyio.streams.buffered
import numpy as np
import pytest

from aiofabric.collectives import join, rendezvous
from aiofabric.collectives.communicator import CollectiveError
from aiofabric.collectives.rendezvous import RendezvousClient, RendezvousError
from aiofabric.collectives.world import World
from tests.support.processes import free_port
from tests.support.rendezvous import meet, serving

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

TIMEOUT = 60.0  # the collectives' and the rendezvous's: the others must fail far sooner than this


async def run_job(size, body, **options):
    """Run `body(rank, comm)` at every rank of a job of `size` ranks joined in this process (each rank its own
    emulated NIC and rendezvous client, rank 0 serving); {rank: what left its join block}."""
    port = free_port()
    outcomes = {}

    async def rank(r):
        try:
            async with join(World(r, size, "127.0.0.1", port), buffer_bytes=4096, piece_bytes=1024,
                            timeout=TIMEOUT, rendezvous_timeout=TIMEOUT, **options) as comm:
                await body(r, comm)
        except BaseExceptionGroup as group:  # join must not wrap: recorded so that the test fails on it
            outcomes[r] = group
        except Exception as error:
            outcomes[r] = error
        else:
            outcomes[r] = None
    with anyio.fail_after(TIMEOUT / 2):  # far below the timeouts: a rank that waited them out fails the test
        async with anyio.create_task_group() as ranks:
            for r in range(size):
                ranks.start_soon(rank, r)
    return outcomes


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("victim", [1, 0])
async def test_a_rank_whose_block_raises_tells_the_others_why_at_once(victim):
    """The victim raises inside its block while the others run an allreduce that needs it: each fails at once with
    a CollectiveError naming the victim and its exception's text; the victim's own error is the ValueError itself.
    Rank 0 serves the rendezvous: its failure must reach the others before its server stops."""
    async def body(r, comm):
        if r == victim:
            raise ValueError("the step diverged\n(loss is nan)")
        await comm.allreduce(np.ones(64, np.float32))
        await comm.allreduce(np.ones(64, np.float32))  # the victim never runs it

    started = anyio.current_time()
    outcomes = await run_job(3, body)
    assert anyio.current_time() - started < TIMEOUT / 2
    assert type(outcomes[victim]) is ValueError and str(outcomes[victim]) == "the step diverged\n(loss is nan)"
    for r in set(range(3)) - {victim}:
        assert isinstance(outcomes[r], CollectiveError), (r, outcomes[r])
        assert f"rank {victim} failed: ValueError: the step diverged (loss is nan)" in str(outcomes[r]), outcomes[r]
        assert "waiting for" not in str(outcomes[r])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_rank_that_fails_before_its_first_round_names_its_reason():
    """Rank 2's NIC cannot open (a bad option): the others, waiting in the rendezvous, fail at once with its
    reason instead of 'ranks [2] did not join' at the rendezvous timeout."""
    port = free_port()
    outcomes = {}

    async def rank(r):
        options = {"loss": 2.0} if r == 2 else {}
        try:
            async with join(World(r, 3, "127.0.0.1", port), buffer_bytes=4096, timeout=TIMEOUT,
                            rendezvous_timeout=TIMEOUT, **options):
                pass
        except Exception as error:
            outcomes[r] = error
    with anyio.fail_after(TIMEOUT / 2):
        async with anyio.create_task_group() as ranks:
            for r in range(3):
                ranks.start_soon(rank, r)
    assert type(outcomes[2]) is ValueError and "loss=2.0" in str(outcomes[2])
    for r in (0, 1):
        assert isinstance(outcomes[r], RendezvousError), outcomes[r]
        assert re.search(r"rank 2 failed: ValueError: loss=2\.0: a fault probability", str(outcomes[r])), outcomes[r]


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_failing_ranks_reason_is_bounded_and_printable():
    reason = "\x1b[31m" + "x" * 5000

    async def body(r, comm):
        if r == 1:
            raise RuntimeError(reason)
        await comm.allreduce(np.ones(8, np.float32))

    outcomes = await run_job(2, body)
    text = str(outcomes[0])
    assert "rank 1 failed: RuntimeError: \\x1b[31mxxx" in text and "\x1b" not in text
    assert len(text) < rendezvous.MAX_REASON + 300


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_block_that_succeeds_everywhere_still_says_goodbye():
    async def body(r, comm):
        out = await comm.allreduce(np.full(16, r + 1, np.float32))
        assert out[0] == 3

    assert await run_job(2, body) == {0: None, 1: None}


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_strangers_holding_every_unclaimed_slot_do_not_keep_the_ranks_out(monkeypatch):
    """A stranger keeps MAX_UNCLAIMED connections open, renewing each as soon as it is dropped: a newcomer drops the
    oldest stranger, and the ranks (which claim as soon as they connect) get in and finish the job."""
    monkeypatch.setattr(rendezvous, "MAX_UNCLAIMED", 8)
    async with serving(2, timeout=20) as (server, port):
        held = []
        stop = anyio.Event()

        async def stranger():
            while not stop.is_set():
                stream = await anyio.connect_tcp("127.0.0.1", port)
                held.append(stream)
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    await stream.receive()  # until the server drops it: then at once another
                await stream.aclose()

        async with anyio.create_task_group() as strangers:
            for _ in range(8):
                strangers.start_soon(stranger)
            with anyio.fail_after(10):
                while server.connections < 8:
                    await anyio.sleep(0.01)
                cards = await meet(port, 2, 15)
            stop.set()
            strangers.cancel_scope.cancel()
        for stream in held:
            await stream.aclose()
        assert cards == [[{"me": 0}, {"me": 1}]] * 2
        assert server.failure is None


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_job_that_cannot_start_names_the_strays_that_were_dropped(monkeypatch):
    """Rank 1 never comes while a stranger's connections claim nothing: the failure names the missing rank and
    how many unclaimed connections were dropped, from where."""
    monkeypatch.setattr(rendezvous, "CLAIM_TIMEOUT", 0.2)
    async with serving(2, timeout=2) as (server, port):
        streams = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(3)]
        client = RendezvousClient("127.0.0.1", port, 0, 2, 2)
        with pytest.raises(RendezvousError) as failure:
            await client.allgather({})
        for stream in streams:
            await stream.aclose()
    assert re.search(r"ranks \[1\] did not join within 2 s; meanwhile 3 connections that claimed no rank were "
                     r"dropped \(3 from 127\.0\.0\.1\): another program is connecting", str(failure.value)), failure.value


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_an_unresolvable_master_addr_is_named_at_once():
    client = RendezvousClient("no-such-host.invalid", 29500, 1, 2, 60)
    with anyio.fail_after(20):  # the resolver's own answer, not the rendezvous timeout
        with pytest.raises(RendezvousError, match=r"the host 'no-such-host\.invalid' \(MASTER_ADDR\) cannot be "
                                                  r"resolved"):
            await client.allgather({})


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_rendezvous_that_drops_a_rank_mid_round_is_named_gone_as_between_rounds():
    """Rank 0 dying while another rank waits in a round (not only while it watches between rounds) is reported the
    same way: the rendezvous is gone, rank 0 or its launcher ended."""
    async def one_round_then_drop(stream):
        async with stream:
            reader = anyio.streams.buffered.BufferedByteReceiveStream(stream)
            await reader.receive_until(b"\n", 4096)
            await stream.send(b'{"all": [{}, {}]}\n')
            await reader.receive_until(b"\n", 4096)  # round 1 asked: the server dies without answering
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, one_round_then_drop)
        client = RendezvousClient("127.0.0.1", port, 1, 2, 10)
        with anyio.fail_after(5):
            assert await client.allgather({}) == [{}, {}]
            with pytest.raises(RendezvousError) as failure:
                await client.allgather({})
        group.cancel_scope.cancel()
    assert str(failure.value) == (f"rank 1: the rendezvous at 127.0.0.1:{port} is gone (rank 0, or the launcher "
                                  "that served it, ended) (IncompleteRead)"), failure.value
