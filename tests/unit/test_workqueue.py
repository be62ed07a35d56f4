"""The send and receive queue codecs (aiofabric/verbs/workqueue.py), pure: plain memory, no emulator, no event loop.

A model replays every post and completion; after each step every WQE still in flight is decoded from the ring and
its search-table entry checked, so a post that overwrites live WQEs, a wrong PSN or a wrong retirement fails. The
fast paths (post_one, post_run) are held byte for byte to the general `post`.
"""
import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.hw import ring
from aiofabric.hw.verbs import PSN_MASK, psn_count
from aiofabric.hw.wqe import (RDMA_WQE_TYPES, RQ_WQE_HEADER, SGE, SQ_RDMA_HEADER, SQ_SLOT, SQ_WQE_HEADER_SLOTS,
                              SqGeometry)
from aiofabric.verbs import workqueue
from aiofabric.verbs.workqueue import RecvQueueCodec, SendQueueCodec

WRITE, READ, SEND = (bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE, bnxt.SQ_RDMA_HDR_WQE_TYPE_READ_WQE,
                     bnxt.SQ_SEND_HDR_WQE_TYPE_SEND)
FLUSHED = bnxt.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
GEOMETRIES = {"variable+msn": SqGeometry(True, 256, True), "variable+psn": SqGeometry(True, 256, False),
              "static+msn": SqGeometry(False, 32, True), "static+psn": SqGeometry(False, 32, False)}


def codec(geometry: SqGeometry, max_unsignaled: int = 5, psn: int = PSN_MASK - 20) -> SendQueueCodec:
    view = memoryview(bytearray(geometry.table_offset + geometry.table_entries * geometry.table_entry.size))
    sq = SendQueueCodec(geometry, view, max_unsignaled=max_unsignaled)
    sq.reset(psn)  # near the top: PSNs wrap within a few messages
    sq.mtu = 256
    return sq


@dataclasses.dataclass
class Wqe:
    number: int  # from 1: the sq_cons_idx its CQE carries, unwrapped
    start: int
    kind: int
    signaled: bool
    length: int
    remote: int
    body: bytes  # the SGEs or the inline data as the ring holds them
    inline: bool
    psn: int
    token: object


class Model:
    """What the codec must have done: every WQE's place and contents, PSNs, signals, tokens."""

    def __init__(self, sq: SendQueueCodec) -> None:
        self.sq, self.live, self.run = sq, list[Wqe](), 0
        self.psn, self.posted, self.retired = sq.psn, 0, 0

    def signal(self, asked: bool) -> bool:
        if asked or self.run >= self.sq.max_unsignaled:
            self.run = 0
            return True
        self.run += 1
        return False

    def add(self, kind: int, length: int, remote: int, body: bytes, inline: bool, asked: bool, token: object,
            taken: int, start: int) -> None:
        self.posted += 1
        self.live.append(Wqe(self.posted, start, kind, self.signal(asked), length, remote if kind in RDMA_WQE_TYPES
                             else 0, body, inline, self.psn, token))
        self.psn = (self.psn + psn_count(length, self.sq.mtu)) & PSN_MASK

    def check(self) -> None:
        """Every live WQE intact in the ring, its search-table entry right, the counters the codec's."""
        sq, geometry = self.sq, self.sq.geometry
        assert (sq.posted, sq.psn, sq.unsignaled_run) == (self.posted, self.psn, self.run)
        assert sq.doorbell() == ((sq.producer % sq.slots) // geometry.slot_unit, ring.epoch(sq.producer, sq.slots))
        for w in self.live:
            size = SQ_WQE_HEADER_SLOTS + len(w.body) // SQ_SLOT
            raw = b"".join(bytes(sq.view[(w.start + i) % sq.slots * SQ_SLOT:][:SQ_SLOT]) for i in range(size))
            kind, flags, wqe_size, imm, length, remote, _, _ = SQ_RDMA_HEADER.unpack(raw[:SQ_RDMA_HEADER.size])
            assert (kind, wqe_size, length) == (w.kind, size, w.length)
            assert flags == (bnxt.SQ_SEND_FLAGS_SIGNAL_COMP if w.signaled else 0) | (
                bnxt.SQ_SEND_FLAGS_INLINE if w.inline else 0)
            assert remote == w.remote and raw[SQ_RDMA_HEADER.size:] == w.body
            entry = geometry.table_entry
            index = geometry.table_index(w.number - 1, w.start % sq.slots)
            values = entry.unpack_from(sq.view, geometry.table_offset + index * entry.size)
            assert geometry.entry_fields(values) == (
                w.psn, (w.psn + psn_count(w.length, sq.mtu)) & PSN_MASK, w.start % sq.slots & 0xFFFF)

    def sq_cons_idx(self, target: int, status: int) -> int:
        """What the CQE naming WQE `target` carries: the next WQE's index modulo sq_size, or (an error with variable
        WQEs) the slot WQE `target` starts at (Linux bnxt_qplib_cq_process_req)."""
        geometry = self.sq.geometry
        if status and geometry.variable:
            return next(w.start for w in self.live if w.number == target) % geometry.slots
        return target % geometry.size

    def retire(self, target: int, status: int) -> tuple[list[object], object]:
        """What a CQE naming WQE `target` must give back; the WQEs before it leave the ring."""
        done = [w.token for w in self.live if w.number < target and w.token is not None]
        after = [w for w in self.live if w.number >= target and w.token is not None]
        named = None
        if after and (after[0].number == target or status):
            named, after[0].token = after[0].token, None  # handed out: a later drain does not give it again
        self.live = [w for w in self.live if w.number > target]
        self.retired = target
        return done, named


def sges(draw, count):
    return [(draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)), draw(st.integers(1, 4096)))
            for _ in range(count)]


@pytest.mark.parametrize("layout", GEOMETRIES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_codec_matches_the_model(layout, data):
    geometry = GEOMETRIES[layout]
    sq = codec(geometry, max_unsignaled=data.draw(st.integers(1, 8)))
    model = Model(sq)
    tokens = iter(range(1, 1 << 30))
    for _ in range(data.draw(st.integers(1, 60))):
        action = data.draw(st.sampled_from(["post", "post_one", "post_run", "retire", "stale"]))
        start = sq.producer
        if action == "post":
            kind = data.draw(st.sampled_from([WRITE, READ, SEND]))
            inline = kind != READ and data.draw(st.booleans())
            if inline:
                payload = data.draw(st.binary(min_size=1, max_size=96))
                body, length, sge_list = payload.ljust(-(-len(payload) // 16) * 16, b"\0"), len(payload), []
            else:
                sge_list = sges(data.draw, data.draw(st.integers(0, 6)))
                body, length = b"".join(SGE.pack(*s) for s in sge_list), sum(s[2] for s in sge_list)
            slots = sq.taken(SQ_WQE_HEADER_SLOTS + len(body) // 16)
            if not sq.room(slots):
                continue
            asked, token = data.draw(st.booleans()), next(tokens)
            remote = data.draw(st.integers(0, 2**64 - 1))
            sq.post(kind, sge_list, length, remote, 7, 9, asked, token, payload if inline else None)
            model.add(kind, length, remote, body, inline, asked, token, slots, start)
        elif action == "post_one":
            address, length, remote = data.draw(st.integers(0, 2**63)), data.draw(st.integers(1, 2000)), 0x1234
            asked, token = data.draw(st.booleans()), next(tokens)
            room = sq.room(sq.taken(3))
            assert sq.post_one(WRITE, address, 5, length, remote, 6, 0, asked, token) == room  # it checks room
            if not room:
                continue
            model.add(WRITE, length, remote, SGE.pack(address, 5, length), False, asked, token, sq.taken(3), start)
        elif action == "post_run":
            count = data.draw(st.sampled_from([data.draw(st.integers(1, 12)), data.draw(st.integers(24, 40))]))
            length = data.draw(st.integers(0, 700))
            if not sq.room(sq.taken(3 if length else 2) * count, count):
                continue
            kind = data.draw(st.sampled_from([WRITE, READ, SEND]))
            offsets = data.draw(st.lists(st.integers(0, 1 << 20), min_size=count, max_size=count))
            remotes = data.draw(st.lists(st.integers(0, 1 << 20), min_size=count, max_size=count))
            marks = set(data.draw(st.lists(st.integers(0, count - 1), max_size=3))) | {count - 1}
            run_tokens = {i: next(tokens) for i in sorted(marks)}
            sq.post_run(kind, 0x10_0000, 5, 0x20_0000, 6, length, offsets, remotes, 0, run_tokens)
            for i in range(count):
                body = SGE.pack(0x10_0000 + offsets[i], 5, length) if length else b""
                model.add(kind, length, 0x20_0000 + remotes[i], body, False, i in marks, run_tokens.get(i),
                          sq.taken(SQ_WQE_HEADER_SLOTS + len(body) // 16), start)
                start += sq.taken(SQ_WQE_HEADER_SLOTS + len(body) // 16)
        elif action == "retire" and model.posted > model.retired:
            target = data.draw(st.integers(model.retired + 1, model.posted))
            status = data.draw(st.sampled_from([0, 0, 0, FLUSHED, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR]))
            sq_cons_idx = model.sq_cons_idx(target, status)
            expected = model.retire(target, status)
            assert sq.retire(sq_cons_idx, status) == expected
            if status:  # the QP is in error: everything else is flushed
                assert sq.drain() == [w.token for w in model.live if w.token is not None]
                model.live, model.retired = [], model.posted
        elif action == "stale":  # a CQE for WQEs already retired (or none posted) changes nothing, as long as the
            # index cannot also name an outstanding WQE (modulo sq_size)
            back = data.draw(st.integers(0, min(3, sq.geometry.size - 1 - (model.posted - model.retired))))
            assert sq.retire((model.retired - back) % sq.geometry.size, 0) == ([], None)
        assert sq.consumer == (model.live[0].start if model.live else sq.producer)  # the ring frees in order
        free = sq.slots - (sq.producer - sq.consumer)
        assert sq.room(free, 0) and not sq.room(free + 1, 0)
        model.check()


@pytest.mark.parametrize("layout", ["variable+msn", "static+psn"])
def test_retirement_survives_many_wraps_of_the_index(layout):
    """70,000 WQEs through a small ring, a CQE per run naming the WQE after the run modulo sq_size (256 slots, or 32
    static WQEs; not 2^16): every run's token comes back once, in order, and the ring never fills up for good."""
    sq = codec(GEOMETRIES[layout], max_unsignaled=64)
    count = min(30, sq.max_wqes // 2)
    offsets = range(0, count * 64, 64)
    tokens, runs = [], 0
    while sq.posted < 70_000:
        assert sq.room(sq.taken(3) * count, count)
        sq.post_run(WRITE, 0x1000, 5, 0x2000, 6, 64, offsets, offsets, 0, {count - 1: runs})
        done, named = sq.retire(sq.posted % sq.geometry.size, 0)
        tokens += done + [named]
        runs += 1
    assert tokens == list(range(runs)) and sq.consumer == sq.producer and sq.outstanding == 0


@pytest.mark.parametrize("layout", GEOMETRIES)
def test_an_error_cqe_blames_the_work_request_it_names(layout):
    """WQEs of 1 to 6 SGEs or inline data wrap the ring many times, then the middle one of three fails. Its error
    CQE names the slot it starts at with variable WQEs (Linux bnxt_qplib_get_cqe_sq_cons), the next WQE's index
    modulo sq_size with static ones: either way the one before succeeds, the one named fails, the one after is
    left to flush."""
    geometry = GEOMETRIES[layout]
    sq, starts = codec(geometry), []
    total = 2 * sq.max_wqes + 3
    for i in range(total):
        inline = b"x" * (1 + i % 90) if i % 7 == 3 else None
        sge_list = [(0x1000 + 64 * k, 5, 8) for k in range(1 + i % 6)]
        starts.append(sq.producer)
        sq.post(WRITE, sge_list, len(inline) if inline is not None else 8 * len(sge_list), 0x2000, 6, 0, True, i,
                inline)
        if i < total - 3:  # the last three stay outstanding
            assert sq.retire((i + 1) % geometry.size, 0) == ([], i)
    assert sq.producer > 2 * sq.slots  # wrapped twice at least
    middle = total - 2
    if geometry.variable:
        assert len({starts[i] - starts[i - 1] for i in range(1, total)}) > 3  # WQEs of many sizes
        index = starts[middle] % sq.slots
    else:
        index = (middle + 1) % geometry.size
    assert sq.retire(index, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR) == ([total - 3], middle)
    assert sq.drain() == [total - 1]


def test_an_unsignaled_wqe_that_fails_fails_the_run_it_belongs_to():
    sq = codec(GEOMETRIES["variable+msn"], max_unsignaled=64)
    offsets = range(0, 8 * 64, 64)
    sq.post_run(WRITE, 0x1000, 5, 0x2000, 6, 64, offsets, offsets, 0, {2: "third", 7: "batch"})
    # WQE 5 (unsignaled, starting at slot 4 * 3) failed: the error CQE names its slot
    assert sq.retire(4 * 3, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR) == (["third"], "batch")
    assert sq.consumer == 5 * 3 and sq.drain() == [] and sq.outstanding == 0


def test_room_counts_slots_and_the_wqe_window():
    sq = codec(GEOMETRIES["static+msn"])
    # 32 static WQEs fill the ring, but 31 at most are in flight: a CQE retiring 32 would name the WQE retired last
    assert sq.max_wqes == 31 and sq.room(8 * 31, 31) and not sq.room(8 * 32, 32) and not sq.fits(8 * 32, 32)
    for i in range(31):
        assert sq.post_one(WRITE, 0x1000, 5, 64, 0x2000, 6, 0, True, i)
    assert not sq.room(8) and sq.fits(8) and not sq.post_one(WRITE, 0x1000, 5, 64, 0x2000, 6, 0, True, "no room")
    assert sq.retire(1, 0) == ([], 0) and sq.room(8) and not sq.room(16, 2) and not sq.room(24)


class Twin:
    """The same posts through the fast paths and through `post`, one WQE at a time."""

    def __init__(self, geometry: SqGeometry) -> None:
        self.fast, self.slow = codec(geometry), codec(geometry)

    def post_one(self, address: int, length: int, signaled: bool, token: object) -> None:
        assert self.fast.post_one(WRITE, address, 5, length, 0x9000, 6, 0, signaled, token)
        self.slow.post(WRITE, [(address, 5, length)], length, 0x9000, 6, 0, signaled, token)

    def post_run(self, kind: int, length: int, offsets: list[int], marks: set[int]) -> None:
        tokens = {i: ("run", i) for i in marks}
        self.fast.post_run(kind, 0x1000, 5, 0x8000, 6, length, offsets, offsets[::-1], 3, tokens)
        for i, offset in enumerate(offsets):
            self.slow.post(kind, [(0x1000 + offset, 5, length)] if length else [], length,
                           0x8000 + offsets[::-1][i] if kind in RDMA_WQE_TYPES else 0, 6 if kind in RDMA_WQE_TYPES
                           else 0, 3, i in marks, tokens.get(i))

    def same(self) -> bool:
        fields = ("producer", "posted", "psn", "msn", "unsignaled_run")
        return (bytes(self.fast.view) == bytes(self.slow.view) and list(self.fast.pending) == list(self.slow.pending)
                and all(getattr(self.fast, f) == getattr(self.slow, f) for f in fields))


@pytest.mark.parametrize("layout", GEOMETRIES)
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 1), st.sampled_from([WRITE, READ, SEND]), st.integers(0, 5000),
                                st.lists(st.integers(0, 1 << 30), min_size=1, max_size=60), st.booleans()),
                      min_size=1, max_size=12))  # runs of 24 and more are written at once (VECTOR_RUN)
def test_the_fast_paths_write_what_post_writes(layout, steps):
    twin = Twin(GEOMETRIES[layout])
    for one, kind, length, offsets, signaled in steps:
        for sq in (twin.fast, twin.slow):  # retire everything (a run may outgrow the ring): it always has room
            sq.drain()
        if one and length:
            twin.post_one(offsets[0], length, signaled, "one")
        else:
            twin.post_run(kind, length, offsets, {len(offsets) - 1} | ({0} if signaled else set()))
        assert twin.same()


def test_the_equivalence_check_sees_a_wrong_search_table_entry(monkeypatch):
    """Tamper with the fast path's start_idx shift: the comparison above must notice."""
    twin = Twin(GEOMETRIES["variable+msn"])
    twin.post_run(WRITE, 64, [0, 64, 128], {2})
    assert twin.same()
    monkeypatch.setattr(workqueue, "_SI_FROM_OFFSET", workqueue._SI_FROM_OFFSET + 1)
    twin.post_run(WRITE, 64, [0, 64, 128], {2})
    assert not twin.same()


def test_receive_queue_posts_tags_and_matches_in_order():
    depth, wqe_size = 4, RQ_WQE_HEADER.size + 2 * SGE.size
    rq = RecvQueueCodec(memoryview(bytearray(depth * wqe_size)), depth, wqe_size)
    assert rq.complete(0) == (None, False)
    for i in range(depth):
        assert rq.room()
        rq.post([(0x1000 * i, 7, 64), (0x1000 * i + 64, 7, 32)][: i % 3], f"r{i}")
    assert not rq.room() and rq.doorbell() == (0, 1)
    kind, flags, size, tag, _ = RQ_WQE_HEADER.unpack_from(rq.view, 2 * wqe_size)
    assert (kind, size, tag) == (bnxt.RQ_WQE_HDR_WQE_TYPE_RCV, wqe_size // 16, 2)
    assert SGE.unpack_from(rq.view, wqe_size + RQ_WQE_HEADER.size) == (0x1000, 7, 64)
    assert rq.complete(0) == ("r0", True)
    assert rq.complete(5) == ("r1", False)  # a CQE naming another receive is reported, the oldest still taken
    assert rq.room(2) and not rq.room(3)
    rq.post([], "r4")  # wraps into slot 0
    assert rq.doorbell() == (1, 1) and RQ_WQE_HEADER.unpack_from(rq.view, 0)[3] == 4
    assert rq.drain() == ["r2", "r3", "r4"] and rq.room(depth)
    rq.reset()
    assert rq.producer == 0 and not any(rq.view)


@pytest.mark.parametrize("layout", GEOMETRIES)
def test_a_wqe_that_cannot_be_packed_changes_nothing(layout):
    """struct.error from any path leaves the codec as it was: no token, no signal counted, nothing published (found
    by review: the unsignaled run advanced on a failed post, and a run failing halfway left a token behind)."""
    sq = codec(GEOMETRIES[layout], max_unsignaled=3)
    sq.post_one(WRITE, 0x1000, 5, 64, 0x2000, 6, 0, False, "first")
    state = lambda: (sq.producer, sq.posted, sq.psn, sq.msn, sq.unsignaled_run, list(sq.pending))  # noqa: E731
    before = state()
    attempts = [lambda: sq.post(WRITE, [(0x1000, 5, 64)], 64, 0x2000, 1 << 32, 0, False, "bad rkey"),
                lambda: sq.post_one(WRITE, 0x1000, 5, 64, 0x2000, 1 << 32, 0, False, "bad rkey"),
                lambda: sq.post_run(WRITE, 2**64 - 200, 5, 0x2000, 6, 64, [0, 64, 128, 256], [0] * 4, 0,
                                    {0: "signaled", 3: "last"}),
                lambda: sq.post_run(WRITE, 0x1000, 5, 0x2000, 6, 0, [0, 64], [0, 2**64], 0, {1: "empty, bad va"})]
    for attempt in attempts:
        with pytest.raises(struct.error):
            attempt()
        assert state() == before
