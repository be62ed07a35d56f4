"""The TCP rendezvous of a job's ranks: rank 0 (or the launcher) listens at MASTER_ADDR:MASTER_PORT, every rank
connects, and in each round every rank sends one JSON object and gets back the list of all ranks' objects (an
allgather of what a ring needs: QP numbers, GIDs, PSNs, buffer keys). A job has a known number of rounds; a ring
takes two (`JOIN_ROUNDS`): the keys, then "connected" (a barrier, so no rank sends before its neighbour's QP is
ready to receive).

Like torchrun's TCP store it authenticates nobody: anyone who reaches the port may claim a free rank. It is
bounded against what a stray or hostile client can do: one JSON line of at most `MAX_LINE` bytes and `MAX_DEPTH`
levels per round, a rank in range claimed once, the job's size and round count, a connection that claims no rank
within `CLAIM_TIMEOUT` dropped, at most `MAX_UNCLAIMED` such connections at once (the oldest is dropped for a
newcomer: a rank claims as soon as it connects, so strays cannot keep it out), and a deadline for the whole job,
after which every rank still waiting is told which ranks never came and how many strays were dropped, from where;
a rank that leaves before the last round is named to the others, and a rank that fails says why
(`{"rank", "size", "failed"}`, cut at `MAX_REASON` characters), which every other rank is told at once. Bind it to
the job's network only.

What a rank learns there, of every rank: both QPs' numbers, GIDs (the NIC's IPv4 address), MACs and initial PSNs,
and both buffers' addresses, rkeys and lengths (launch.py `Endpoint.card`). Each QP is connected to the GID its
neighbour's card names, and the NIC takes that QP's packets from that address only (rxe's check_addr; the emulated
NIC counts the others as dropped_bad_source), so the cards let nobody write into a rank's buffers from another
address. On one host's loopback that is weaker: any local user may send from a neighbour's 127.0.0.x (from a port
other than its 4791), so a rank of a job on one host could still write into another rank's buffers. Nor are the
cards a defence against a client that claims a free rank: it is a rank, and its neighbours connect to the card it
publishes.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import socket
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from ..errors import FabricError
from ..util.escape import printable
from ..util.json_depth import json_depth

log = logging.getLogger("aiofabric.collectives")
MAX_LINE = 64 << 10  # one rank's round: a few QPInfos and keys
MAX_DEPTH = 16  # JSON nesting of a round's data (a card is 2 deep): deeper would not even encode back
JOIN_ROUNDS = 2  # a ring's: the cards, then "connected"
MAX_UNCLAIMED = 64  # connections open at once that have claimed no rank yet: a newer one drops the oldest
CLAIM_TIMEOUT = 3.0  # seconds a connection has to claim a rank (a rank sends its claim as soon as it connects)
MAX_REASON = 500  # characters of a failing rank's reason, as relayed to the others
ANSWER_GRACE = 5.0  # seconds a rank waits for an answer beyond the rendezvous timeout
CONNECT_RETRY = 0.1  # seconds between attempts while rank 0 is not listening yet
FAREWELL = 5.0  # seconds a failed rendezvous gives its handlers to tell their ranks why


class RendezvousError(FabricError):
    """The rendezvous failed: a rank never came, left, or disagreed; or the server refused a request."""


class RendezvousServer:
    """Serves one job of `size` ranks and `rounds` rounds on `listener` until every rank has left, or `timeout`
    seconds."""

    def __init__(self, size: int, timeout: float, rounds: int = JOIN_ROUNDS) -> None:
        self.size, self.timeout, self.total_rounds = size, timeout, rounds
        self.rounds: list[dict[int, Any]] = []
        self.complete: list[anyio.Event] = []
        self.joined: set[int] = set()
        self.left: set[int] = set()
        self.failure: str | None = None
        self.explained = False  # the failure is a rank's own notice of why it failed
        self.failed = anyio.Event()
        self.finished = anyio.Event()  # the last round completed
        self.refused = 0
        self.connections = 0
        self.pending: dict[anyio.CancelScope, str] = {}  # connections yet to claim a rank, oldest first: their hosts
        self.dropped: collections.Counter[str] = collections.Counter()  # strays dropped unclaimed, by host
        self.watching: dict[int, anyio.abc.ByteStream] = {}  # after the last round: ranks whose departure is news
        self._changed = anyio.Event()

    async def serve(self, listener: anyio.abc.Listener[Any]) -> None:
        ends = anyio.current_time() + self.timeout
        async with anyio.create_task_group() as group:
            async def deadline() -> None:  # for the rounds; the watch after them lasts as long as the job
                with anyio.move_on_after(self.timeout) as waiting:
                    async with anyio.create_task_group() as either:
                        async def until(event: anyio.Event) -> None:
                            await event.wait()
                            either.cancel_scope.cancel()
                        either.start_soon(until, self.failed)
                        either.start_soon(until, self.finished)
                if not waiting.cancelled_caught:
                    return
                missing = sorted(set(range(self.size)) - self.joined)
                self._fail((f"ranks {missing} did not join within {self.timeout:g} s" if missing else
                            f"the rendezvous did not finish within {self.timeout:g} s") + self._strays())

            async def serve_all() -> None:
                await listener.serve(self._client, task_group=group)

            group.start_soon(deadline)
            group.start_soon(serve_all)
            while len(self.left) < self.size and self.failure is None:
                await self._wait_change()
            # the ranks still connected are told why, then the server stops; when a rank said why it failed, ranks
            # yet to come are told too when they come (until the deadline), not left to find no rendezvous
            with anyio.move_on_after(max(FAREWELL, ends - anyio.current_time()) if self.explained else FAREWELL):
                while self.failure is not None and (self.connections or self.explained and
                                                    len(self.joined) < self.size):
                    await self._wait_change()
            group.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await listener.aclose()  # later connections are refused, not left waiting for an answer

    async def _wait_change(self) -> None:
        self._changed = anyio.Event()
        await self._changed.wait()

    def _changed_now(self) -> None:
        self._changed.set()

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("rendezvous: %s", reason)
            self.failed.set()
            self._changed_now()

    def _strays(self) -> str:
        """What strays did meanwhile, for a failure's message: how many connections were dropped without claiming
        a rank, from which hosts (the most first)."""
        if not self.dropped:
            return ""
        hosts = ", ".join(f"{count} from {host}" for host, count in self.dropped.most_common(3))
        more = " and others" if len(self.dropped) > 3 else ""
        return (f"; meanwhile {sum(self.dropped.values())} connections that claimed no rank were dropped ({hosts}"
                f"{more}): another program is connecting to the rendezvous port")

    async def _client(self, stream: anyio.abc.ByteStream) -> None:
        rank = None
        host = _remote_host(stream)
        claim = anyio.CancelScope()  # cancelled to drop this connection for a newer one while it claims nothing
        if len(self.pending) >= MAX_UNCLAIMED:  # strays must not pin the server: the oldest goes, so a rank (which
            oldest, oldest_host = next(iter(self.pending.items()))  # claims as soon as it connects) always gets in
            del self.pending[oldest]
            self.dropped[oldest_host] += 1
            oldest.cancel()
        self.pending[claim] = host
        self.connections += 1
        reader = BufferedByteReceiveStream(stream)
        try:
            while True:
                line: bytes | None = None
                try:
                    if rank is None:
                        with claim, anyio.fail_after(CLAIM_TIMEOUT):
                            line = await reader.receive_until(b"\n", MAX_LINE)
                        if line is None:  # dropped for a newer connection
                            break
                        self.pending.pop(claim, None)
                    else:
                        with anyio.fail_after(self.timeout):
                            line = await reader.receive_until(b"\n", MAX_LINE)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    break
                except anyio.DelimiterNotFound:
                    raise RendezvousError(f"a request line longer than {MAX_LINE} bytes") from None
                except TimeoutError:
                    if rank is None and self.pending.pop(claim, None) is not None:
                        self.dropped[host] += 1
                    raise RendezvousError("no request for " + (f"{self.timeout:g} s" if rank is not None else
                                                                f"{CLAIM_TIMEOUT:g} s after connecting")) from None
                notice = _notice(line, self.size)
                if notice is not None:  # a rank that fails says why: the others are told at once
                    if rank is None:
                        rank = self._claim(notice[0])
                    elif notice[0] != rank:
                        raise RendezvousError(f"this connection is rank {rank}, not {notice[0]}")
                    self.explained = self.failure is None
                    self._fail(f"rank {rank} failed: {notice[1]}")
                    break
                message = _parse(line, self.size, self.total_rounds)
                if rank is None:
                    rank = self._claim(message["rank"])
                elif message["rank"] != rank:
                    raise RendezvousError(f"this connection is rank {rank}, not {message['rank']}")
                await self._round(stream, reader, rank, message)
                if message["round"] == self.total_rounds - 1:
                    await self._watch(stream, reader, rank)
                    break
        except RendezvousError as error:
            self.refused += 1
            await _send(stream, {"error": str(error)})
            if rank is not None:
                self._fail(f"rank {rank}: {error}")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            self.connections -= 1
            self.pending.pop(claim, None)
            self._changed_now()
            await stream.aclose()
            if rank is not None:
                self.left.add(rank)
                done = len(self.rounds) == self.total_rounds and self.complete[-1].is_set()
                if not done:  # the others wait for a round it will not send
                    self._fail(rank_gone(rank))
                self._changed_now()

    async def _watch(self, stream: anyio.abc.ByteStream, reader: BufferedByteReceiveStream, rank: int) -> None:
        """After the last round the connection stays open while the rank works: a line from it is its goodbye; the
        connection dropping without one means its process is gone, and every rank still working is told which, so
        its collectives fail naming it instead of waiting for their timeouts."""
        self.watching[rank] = stream
        try:
            line: bytes | None = await reader.receive_until(b"\n", MAX_LINE)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.DelimiterNotFound, OSError):
            line = None
        del self.watching[rank]
        notice = None if line is None else _notice(line, self.size)
        if line is not None and (notice is None or notice[0] != rank):
            return  # its goodbye
        news = {"failed": rank, "error": f"rank {rank} failed: {notice[1]}" if notice is not None else rank_gone(rank)}
        log.warning("rendezvous: %s", news["error"])
        async with anyio.create_task_group() as relay:  # at once to all: one slow reader delays no other
            for other in list(self.watching.values()):
                relay.start_soon(_send, other, news)

    def _claim(self, rank: int) -> int:
        if rank in self.joined:
            raise RendezvousError(f"rank {rank} is already taken")
        self.joined.add(rank)
        self._changed_now()
        return rank

    async def _round(self, stream: anyio.abc.ByteStream, reader: BufferedByteReceiveStream, rank: int,
                     message: dict[str, Any]) -> None:
        number = message["round"]
        if number > len(self.rounds) or number < len(self.rounds) - 1:
            raise RendezvousError(f"round {number} is out of step (the job is at round {len(self.rounds) - 1})")
        if number == len(self.rounds):
            self.rounds.append({})
            self.complete.append(anyio.Event())
        if rank in self.rounds[number]:
            raise RendezvousError(f"rank {rank} sent round {number} twice")
        self.rounds[number][rank] = message["data"]
        if len(self.rounds[number]) == self.size:
            self.complete[number].set()
            if number == self.total_rounds - 1:
                self.finished.set()
        async with anyio.create_task_group() as group:  # the round completes, or the job fails, or the rank leaves
            async def failed() -> None:
                await self.failed.wait()
                group.cancel_scope.cancel()

            async def watch() -> None:
                try:
                    line = await reader.receive_until(b"\n", MAX_LINE)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
                    self._fail(rank_gone(rank))
                except anyio.DelimiterNotFound:
                    self._fail(f"rank {rank} sent a request before round {number} was complete")
                else:
                    notice = _notice(line, self.size)
                    if notice is not None and notice[0] == rank:
                        self.explained = self.failure is None
                        self._fail(f"rank {rank} failed: {notice[1]}")
                    else:
                        self._fail(f"rank {rank} sent a request before round {number} was complete")
            group.start_soon(failed)
            group.start_soon(watch)
            await self.complete[number].wait()
            group.cancel_scope.cancel()
        if self.failure is not None:
            raise RendezvousError(self.failure)
        await _send(stream, {"round": number, "all": [self.rounds[number][r] for r in range(self.size)]})


def _parse(line: bytes, size: int, rounds: int) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise RendezvousError(f"not a JSON object: {type(error).__name__}") from None
    if not isinstance(message, dict) or set(message) != {"rank", "size", "round", "data"}:
        raise RendezvousError("a request is {\"rank\", \"size\", \"round\", \"data\"}")
    for field in ("rank", "size", "round"):
        if not isinstance(message[field], int) or isinstance(message[field], bool):
            raise RendezvousError(f"{field} must be an integer")
    if message["size"] != size:
        raise RendezvousError(f"this job has {size} ranks, not {message['size']}")
    if not 0 <= message["rank"] < size:
        raise RendezvousError(f"rank {message['rank']} is not in [0, {size - 1}]")
    if not 0 <= message["round"] < rounds:
        raise RendezvousError(f"round {message['round']} is not in [0, {rounds - 1}]")
    if not isinstance(message["data"], dict):
        raise RendezvousError("data must be a JSON object")
    if json_depth(message["data"]) > MAX_DEPTH:
        raise RendezvousError(f"data nested deeper than {MAX_DEPTH} levels")
    return message


def _notice(line: bytes, size: int) -> tuple[int, str] | None:
    """A rank's failure notice, `{"rank", "size", "failed": why}`: (rank, why made printable and cut at
    MAX_REASON characters); None for any other line."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict) or set(message) != {"rank", "size", "failed"}:
        return None
    rank, job, why = message["rank"], message["size"], message["failed"]
    if type(rank) is not int or type(job) is not int or job != size or not 0 <= rank < size or type(why) is not str:
        return None
    return rank, printable(why, MAX_REASON)


def _remote_host(stream: anyio.abc.ByteStream) -> str:
    try:
        return str(stream.extra(anyio.abc.SocketAttribute.remote_address)[0])
    except (anyio.TypedAttributeLookupError, TypeError, IndexError):
        return "an unknown address"


async def _send(stream: anyio.abc.ByteStream, message: dict[str, Any]) -> None:
    try:
        with anyio.move_on_after(5):
            await stream.send(json.dumps(message).encode() + b"\n")
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


class RendezvousClient:
    """One rank's connection to the rendezvous at host:port, made on its first round (rank 0 may start last);
    `allgather(data)` is one round. A connection the server turns away before the first answer (too many strangers connected, or not listening yet) is retried until `timeout`."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout: float) -> None:
        self.host, self.port, self.rank, self.size, self.timeout = host, port, rank, size, timeout
        self.stream: anyio.abc.ByteStream | None = None
        self.round = 0

    async def allgather(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        line = json.dumps({"rank": self.rank, "size": self.size, "round": self.round, "data": data}).encode()
        if len(line) >= MAX_LINE:
            raise ValueError(f"rendezvous data of {len(line)} bytes exceeds {MAX_LINE}")
        where = f"rank {self.rank}: the rendezvous at {self.host}:{self.port}"
        waited = self.timeout + ANSWER_GRACE  # the server's answer at its own timeout names who is missing: wait for it
        with anyio.move_on_after(waited):
            while True:
                if self.stream is None:
                    try:
                        self.stream = await anyio.connect_tcp(self.host, self.port)
                    except socket.gaierror as error:
                        if error.errno == socket.EAI_AGAIN:  # the resolver is busy: a retry may succeed
                            await anyio.sleep(CONNECT_RETRY)
                            continue
                        raise RendezvousError(f"{where}: the host {self.host!r} (MASTER_ADDR) cannot be resolved: "
                                              f"{error.strerror or error}") from None
                    except OSError:
                        await anyio.sleep(CONNECT_RETRY)
                        continue
                    self.reader = BufferedByteReceiveStream(self.stream)
                try:
                    await self.stream.send(line + b"\n")
                    text = await self.reader.receive_until(b"\n", MAX_LINE * (self.size + 1))
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError) as error:
                    await self.aclose()
                    if self.round == 0:  # turned away before it knew us: try again
                        await anyio.sleep(CONNECT_RETRY)
                        continue
                    raise RendezvousError(f"rank {self.rank}: {self.gone()} ({type(error).__name__})") from None
                except anyio.DelimiterNotFound:
                    await self.aclose()
                    raise RendezvousError(f"{where} answered more than {MAX_LINE * (self.size + 1)} bytes") from None
                try:
                    answer = _answer(text, self.size, where)
                except RendezvousError:
                    await self.aclose()  # the server failed the job (or is not one): it knows, nothing more to say
                    raise
                self.round += 1
                return answer
        raise RendezvousError(f"{where}: round {self.round} got no answer within {waited:g} s (is rank 0 "
                              "running, and MASTER_ADDR/MASTER_PORT the same for every rank?)")

    async def watch(self) -> str:
        """After the last round: wait for news of a rank that is gone (or of the rendezvous itself going) and
        return it, naming the rank. Cancel it to stop watching."""
        assert self.stream is not None
        try:
            while True:
                text = await self.reader.receive_until(b"\n", MAX_LINE)
                news = json.loads(text)
                if isinstance(news, dict) and isinstance(news.get("error"), str):
                    return news["error"]
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.DelimiterNotFound,
                ValueError, OSError):
            return self.gone()

    def gone(self) -> str:
        """What a rank says when the rendezvous drops its connection mid-job, in a round or between rounds."""
        return f"the rendezvous at {self.host}:{self.port} is gone (rank 0, or the launcher that served it, ended)"

    async def fail(self, reason: str) -> None:
        """Tell the rendezvous this rank failed and why (cut at MAX_REASON characters), wait until it has passed
        that on (it closes the connection), and close: the other ranks fail at once naming this one and its reason,
        instead of waiting for it until their timeout. A rank not yet connected connects to say it. Shielded from
        cancellation and bounded by FAREWELL seconds; a rendezvous out of reach is not an error here."""
        line = json.dumps({"rank": self.rank, "size": self.size, "failed": reason[:MAX_REASON]}).encode() + b"\n"
        with anyio.CancelScope(shield=True), anyio.move_on_after(FAREWELL):
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                                     OSError):
                while self.stream is None:
                    try:
                        self.stream = await anyio.connect_tcp(self.host, self.port)
                    except socket.gaierror:
                        return
                    except OSError:
                        await anyio.sleep(CONNECT_RETRY)
                await self.stream.send(line)
                while True:
                    await self.stream.receive()
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def goodbye(self) -> None:
        """Tell the rendezvous this rank leaves on purpose (its work is done), and close."""
        if self.stream is not None:
            with anyio.move_on_after(5), contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError,
                                                             OSError):
                await self.stream.send(b'{"goodbye": true}\n')
        await self.aclose()

    async def aclose(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.aclose()


def rank_gone(rank: int) -> str:
    """What the others are told when a rank's connection drops without its goodbye, in a round or between rounds
    (whichever it was in when its process ended)."""
    return (f"rank {rank} is gone (its connection to the rendezvous dropped before it said goodbye: its process "
            "ended)")


def _answer(text: bytes, size: int, where: str) -> list[dict[str, Any]]:
    """The round's cards, or the server's error, from an answer line; anything else is the server's fault."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):
        raise RendezvousError(f"{where} sent an answer that is not JSON") from None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise RendezvousError(f"{where}: {answer['error']}")
    cards = answer.get("all") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or len(cards) != size or not all(isinstance(card, dict) for card in cards):
        raise RendezvousError(f"{where} sent a malformed answer (not {size} objects under \"all\")")
    return cards
