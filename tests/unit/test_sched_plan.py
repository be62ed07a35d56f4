"""The scheduler's planner (aiofabric/sched/plan.py): pure, so hypothesis checks it over many random batches."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.sched.plan import PlannedCall, Span, Wait, plan

BUFFER_BYTES = 64


@st.composite
def batches(draw, max_calls=40):
    """Random calls over up to 5 queues on up to 3 devices, touching random byte ranges or 16-byte slots of up to 3
    buffers."""
    queue_count = draw(st.integers(1, 5))
    devices = [draw(st.integers(0, 2)) for _ in range(queue_count)]
    keys = st.sampled_from("xyz")
    any_range = st.builds(lambda key, a, b: Span(key, min(a, b), max(a, b)), keys,
                          st.integers(0, BUFFER_BYTES), st.integers(0, BUFFER_BYTES))
    slot = st.builds(lambda key, k: Span(key, k * 16, k * 16 + 16), keys, st.integers(0, BUFFER_BYTES // 16 - 1))
    span = st.one_of(any_range, slot)  # slots repeat exactly: the planner's no-cut path, mixed with cuts and merges
    call = st.builds(lambda q, r, w: PlannedCall(f"q{q}", f"d{devices[q]}", tuple(r), tuple(w)),
                     st.integers(0, queue_count - 1), st.lists(span, max_size=2), st.lists(span, max_size=2))
    return draw(st.lists(call, min_size=1, max_size=max_calls))


def conflicts(calls):
    """Ground truth, by brute force over every pair: (i, j) with i < j that must not overlap in time."""
    def overlap(a, b):
        return any(x.key == y.key and max(x.start, y.start) < min(x.stop, y.stop) for x in a for y in b)
    for (i, a), (j, b) in itertools.combinations(enumerate(calls), 2):
        if overlap(a.writes, b.reads) or overlap(a.reads, b.writes) or overlap(a.writes, b.writes):
            yield i, j


def simulate(result, durations, pipelined=frozenset()):
    """Run the plan in virtual time: start/end per call. A pipelined queue (a QP) starts a call once the previous
    one started (and, if fenced, once every earlier one ended) and completes in order; other queues run one call
    at a time. A wait on a counter that is never signalled, or on a call not yet run, is a deadlock."""
    start, end, signalled = {}, {}, {}
    queue_state = {}  # queue -> (last start, last end)
    for s in result.submissions:
        last_start, last_end = queue_state.get(s.queue, (0.0, 0.0))
        ready = last_start if s.queue in pipelined and not s.fence else last_end
        for w in s.waits:
            if (w.queue, w.value) not in signalled:
                raise AssertionError(f"deadlock: call {s.call} waits for queue {w.queue} >= {w.value}, never signalled "
                                     "before it")
            ready = max(ready, signalled[w.queue, w.value])
        start[s.call] = ready
        end[s.call] = max(ready + durations[s.call], last_end)  # in-order completion
        queue_state[s.queue] = (ready, end[s.call])
        if s.signal is not None:
            assert s.signal == s.position
            signalled[s.queue, s.signal] = end[s.call]
    return start, end


@settings(max_examples=200, deadline=None)
@given(calls=batches(), data=st.data())
def test_every_dependency_is_respected_with_random_durations(calls, data):
    result = plan(calls)
    durations = data.draw(st.lists(st.floats(0.0, 10.0), min_size=len(calls), max_size=len(calls)))
    pipelined = data.draw(st.frozensets(st.integers(0, len(result.queues) - 1)))
    start, end = simulate(result, durations, pipelined)
    for i, j in conflicts(calls):
        assert end[i] <= start[j], f"call {j} started before call {i} ended\n{result.describe()}"


@settings(max_examples=200, deadline=None)
@given(calls=batches())
def test_signals_waits_timeline_and_finalisers_are_minimal_and_well_formed(calls):
    result = plan(calls)
    call_at = {(s.queue, s.position): s.call for s in result.submissions}
    awaited = {(w.queue, w.value) for s in result.submissions for w in s.waits}
    awaited |= {(w.queue, w.value) for f in result.finalisers for w in f.waits}
    for s in result.submissions:
        assert (s.signal is not None) == ((s.queue, s.position) in awaited), "a signal without a waiter, or a " \
                                                                              "waiter without a signal"
        assert s.timeline_wait == (s.position == 1)
        for w in s.waits:
            assert w.queue != s.queue
            assert call_at[w.queue, w.value] < s.call, "a wait on a later call"
        assert len({w.queue for w in s.waits}) == len(s.waits), "two waits on one producer queue"
    assert sorted(f.device for f in result.finalisers) == list(range(len(result.devices)))
    last = {}
    for s in result.submissions:
        last[s.queue] = s.position
    assert {(w.queue, w.value) for f in result.finalisers for w in f.waits} == set(last.items())
    for f in result.finalisers:
        assert all(result.device_of_queue[w.queue] == f.device for w in f.waits)
    # plan size is linear: at most one wait per other queue per call, at most one signal per call
    assert result.waits <= len(calls) * (len(result.queues) - 1)
    assert result.signals <= len(calls)


def test_only_the_newest_dependency_per_producer_queue_is_kept():
    a, b = Span("buf", 0, 8), Span("buf", 8, 16)
    result = plan([PlannedCall("p", "d", writes=(a,)), PlannedCall("p", "d", writes=(b,)),
                   PlannedCall("c", "d", reads=(a, b))])
    assert result.submissions[2].waits == (Wait(0, 2),)  # the producer's second call implies its first
    assert result.submissions[0].signal is None and result.submissions[1].signal == 2


def test_a_wait_already_made_at_a_newer_point_is_dropped_and_same_queue_is_a_fence():
    x, y = Span("x", 0, 8), Span("y", 0, 8)
    result = plan([PlannedCall("p", "d", writes=(x,)), PlannedCall("p", "d", writes=(y,)),
                   PlannedCall("c", "d", reads=(y,)), PlannedCall("c", "d", reads=(x,)), PlannedCall("c", "d", writes=(y,))])
    c0, c1, c2 = result.submissions[2:]
    assert c0.waits == (Wait(0, 2),)
    assert c1.waits == () and not c1.fence  # c already waited for p >= 2, which implies p's call 1
    assert c2.waits == () and c2.fence  # write-after-read on its own queue: in order, a fence for pipelined queues


def test_disjoint_ranges_and_reads_after_reads_need_no_waits():
    result = plan([PlannedCall("p", "d", writes=(Span("x", 0, 8),)), PlannedCall("c", "d", writes=(Span("x", 8, 16),)),
                   PlannedCall("p", "d", reads=(Span("z", 0, 8),)), PlannedCall("c", "d", reads=(Span("z", 0, 8),))])
    assert result.waits == 0
    assert [s.signal for s in result.submissions] == [None, None, 2, 2]  # only the finalisers wait


def test_a_queue_on_two_devices_is_refused():
    with pytest.raises(ValueError, match="queue 'q' was used on device 'a', not 'b'"):
        plan([PlannedCall("q", "a"), PlannedCall("q", "b")])


def test_plan_size_and_interval_maps_stay_linear_on_a_long_chain():
    n = 20_000
    calls = [PlannedCall(f"q{i % 8}", "d", reads=(Span("buf", (i - 1) % 100 * 8, (i - 1) % 100 * 8 + 8),),
                    writes=(Span("buf", i % 100 * 8, i % 100 * 8 + 8),)) for i in range(n)]
    result = plan(calls)
    assert len(result.submissions) == n
    assert result.waits <= 3 * n and result.signals <= n  # each call: RAW, WAR, WAW at most


def test_describe_and_dot_name_queues_waits_and_signals():
    result = plan([PlannedCall("gpu", "host", writes=(Span("x", 0, 4),)), PlannedCall("qp", "nic", reads=(Span("x", 0, 4),))])
    text = result.describe(["kernel", "write"])
    assert "gpu[1] kernel; wait timeline; signal gpu=1" in text
    assert "qp[1] write; wait timeline; wait gpu>=1; signal qp=1" in text
    assert "finaliser nic: wait qp>=1; publish epoch" in text
    dot = result.to_dot(["kernel", "write"])
    assert dot.startswith("digraph batch {") and "c0 -> c1;" in dot and 'label="gpu"' in dot


def test_the_cyclic_gc_is_paused_while_planning_and_left_as_it_was():
    import gc
    import threading

    seen = []

    def calls(n=50):
        for i in range(n):
            seen.append(gc.isenabled())  # a generator of calls sees the collector as planning leaves it
            yield PlannedCall(f"q{i % 3}", "d", writes=(Span("x", i, i + 1),))

    assert gc.isenabled()
    plan(calls())
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(ValueError):  # a refused batch resumes it too
        plan([PlannedCall("q", "a"), PlannedCall("q", "b")])
    assert gc.isenabled()
    gc.disable()
    try:  # a program that disabled it itself keeps it disabled
        plan(calls())
        assert not gc.isenabled()
    finally:
        gc.enable()
    # planners in several threads: the collector is back on once the last one is done, never before
    barrier = threading.Barrier(4)
    enabled_mid_plan = []

    def plan_in_thread():
        def slow_calls():
            for i in range(200):
                if i == 100:
                    barrier.wait(timeout=10)  # all four are planning now
                enabled_mid_plan.append(gc.isenabled())
                yield PlannedCall("q", "d", reads=(Span("y", 0, 8),))
        plan(slow_calls())
    threads = [threading.Thread(target=plan_in_thread) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(enabled_mid_plan) == 800 and not any(enabled_mid_plan) and gc.isenabled()
