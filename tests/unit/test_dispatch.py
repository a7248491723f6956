"""Dispatch: candidates, the admission queue's order, bounds and departures, late binding."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.dispatcher import CLIENT_GONE, Dispatcher
from vllm_gateway.dispatch.policies import POLICIES, make_policy
from vllm_gateway.dispatch.prefill_rate import seconds_per_byte
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.errors import NoWorkerAvailable, QueueFull, QueueTimeout
from vllm_gateway.workers import EngineStats, WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(10)


def info(i: int = 0, priority: int | None = None):
    headers = {"x-priority": str(priority)} if priority is not None else {}
    return parse_request("/v1/completions", b'{"model": "m"}', f"r{i}", headers)


def fleet(policy: str = "queue", states=(WorkerState.READY,), **config):
    registry = WorkerRegistry()
    workers = []
    for i, state in enumerate(states):
        w, _ = registry.add(f"http://w{i}", models=("m",))
        registry.set_state(w, state, "test")
        workers.append(w)
    d = Dispatcher(registry, make_policy(policy, random.Random(0)), config=DispatchConfig(**config))
    return registry, workers, d


def full(registry, worker, running: float = 1, waiting: float = 1) -> None:
    """A scrape saying `worker` runs all it can and queues more: no token left."""
    registry.set_stats(worker, EngineStats(running, waiting, None, 0.0))


def room(registry, worker, running: float = 0, waiting: float = 0) -> None:
    registry.set_stats(
        worker, EngineStats(running, waiting, None, 0.0), sent=worker.sent_since_scrape
    )


async def hold(d, i, order, release: asyncio.Event, **kw):
    async with d.lease(info(i, **kw)) as lease:
        order.append((i, lease))
        await release.wait()


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_only_available_workers_are_picked(policy):
    states = (WorkerState.DRAINING, WorkerState.READY, WorkerState.UNHEALTHY,
              WorkerState.JOINING, WorkerState.READY)  # fmt: skip
    registry, ws, d = fleet(policy, states)
    for i in range(40):
        async with d.lease(info(i)) as lease:
            assert lease.worker.state is WorkerState.READY
    assert {w.url: w.completed for w in ws} == {
        "http://w0": 0, "http://w1": ws[1].completed, "http://w2": 0,
        "http://w3": 0, "http://w4": ws[4].completed}  # fmt: skip
    assert all(w.inflight == 0 for w in ws)
    registry.set_state(ws[1], WorkerState.DRAINING, "test")
    registry.set_state(ws[4], WorkerState.UNHEALTHY, "test")
    with pytest.raises(NoWorkerAvailable):
        async with d.lease(info()):
            pass


async def test_waiting_requests_are_bound_in_order_as_room_appears():
    registry, (w,), d = fleet()
    full(registry, w, running=2)  # capacity 2, 3 there: no token
    order, release = [], asyncio.Event()
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(hold(d, i, order, release)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert d.admission.depth == 4 and order == []
    room(registry, w, running=0)  # 2 free slots: the first two go
    await asyncio.sleep(0.01)
    assert [i for i, _ in order] == [0, 1] and d.admission.depth == 2
    assert all(lease.waited > 0 for _, lease in order)
    release.set()  # each release frees a slot: the rest follow in order
    await asyncio.gather(*tasks)
    assert [i for i, _ in order] == [0, 1, 2, 3]
    assert d.admission.depth == 0 and d.admission.admitted == 4 and w.inflight == 0


async def test_priority_goes_first_then_arrival_order():
    registry, (w,), d = fleet()
    full(registry, w)
    order, release = [], asyncio.Event()
    tasks = []
    for i, prio in [(0, None), (1, 5), (2, -3), (3, None), (4, -3)]:
        tasks.append(asyncio.create_task(hold(d, i, order, release, priority=prio)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    room(registry, w, running=0)  # one slot: the best waiter; each release, the next
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(*tasks)
    assert [i for i, _ in order] == [2, 4, 0, 3, 1]


async def test_new_requests_do_not_overtake_waiting_ones():
    registry, (w,), d = fleet()
    full(registry, w)
    order, release = [], asyncio.Event()
    first = asyncio.create_task(hold(d, 0, order, release))
    await asyncio.sleep(0.01)
    # Room for one appeared without an event (no scrape told the dispatcher).
    d.buckets.by_worker[w].tokens = 1.0
    w.stats, w.others = EngineStats(0, 0, None, 0.0), 0.0
    second = asyncio.create_task(hold(d, 1, order, release))
    await asyncio.sleep(0.01)
    assert [i for i, _ in order] == [0] and d.admission.depth == 1  # the newcomer waits
    release.set()
    await first
    room(registry, w, running=0)
    await second
    assert [i for i, _ in order] == [0, 1]


async def test_queue_length_bound_gives_queue_full():
    registry, (w,), d = fleet(max_queued=2)
    full(registry, w)
    waiting = [asyncio.create_task(hold(d, i, [], asyncio.Event())) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as e:
        async with d.lease(info(9)):
            pass
    assert e.value.status == 429 and e.value.retry_after >= 1
    assert d.admission.rejected == 1 and d.admission.depth == 2
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert d.admission.depth == 0 and d.admission.abandoned == 2


async def test_queue_wait_bound_gives_queue_timeout():
    registry, (w,), d = fleet(max_queue_wait=0.1)
    full(registry, w)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(QueueTimeout) as e:
        async with d.lease(info()):
            pass
    assert 0.09 < loop.time() - start < 2.0
    assert e.value.status == 503 and e.value.code == "queue_timeout"
    assert d.admission.timed_out == 1 and d.admission.depth == 0


async def test_a_client_that_leaves_leaves_the_queue():
    registry, (w,), d = fleet()
    full(registry, w)
    order, release = [], asyncio.Event()
    leaving = asyncio.create_task(hold(d, 0, order, release))
    staying = asyncio.create_task(hold(d, 1, order, release))
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.sleep(0.01)
    assert d.admission.depth == 1 and d.admission.abandoned == 1
    room(registry, w, running=0)
    await asyncio.sleep(0.01)
    assert [i for i, _ in order] == [1]  # the one that left got nothing
    release.set()
    await staying
    assert leaving.cancelled() and w.inflight == 0


async def test_a_client_that_leaves_just_as_it_is_bound_frees_the_worker():
    registry, (w,), d = fleet()
    full(registry, w)
    released = []
    d.on_release.append(released.append)
    task = asyncio.create_task(hold(d, 0, [], asyncio.Event()))
    await asyncio.sleep(0.01)
    room(registry, w, running=0)  # binds the waiter synchronously ...
    assert w.inflight == 1
    task.cancel()  # ... and the client leaves before the task resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert w.inflight == 0 and [lease.outcome for lease in released] == [CLIENT_GONE]


async def test_registry_changes_wake_the_queue():
    registry, (a, b), d = fleet(states=(WorkerState.READY, WorkerState.JOINING))
    full(registry, a)
    order, release = [], asyncio.Event()
    task = asyncio.create_task(hold(d, 0, order, release))
    await asyncio.sleep(0.01)
    registry.set_state(b, WorkerState.READY, "probe passed")  # a worker with room appears
    await asyncio.sleep(0.01)
    assert order and order[0][1].worker is b
    release.set()
    await task
    # Every worker gone while requests wait: they get 503 at once (the transition itself
    # wakes the queue), not at the timeout (max_queue_wait: 30 s).
    full(registry, b)
    waiting = asyncio.create_task(hold(d, 1, [], asyncio.Event()))
    await asyncio.sleep(0.01)
    registry.set_state(a, WorkerState.UNHEALTHY, "probe failed")
    assert d.admission.depth == 1  # b is full, not gone: still waiting
    registry.set_state(b, WorkerState.DRAINING, "admin")
    assert d.admission.depth == 0  # failed within the transition, before any other event
    with pytest.raises(NoWorkerAvailable):
        await asyncio.wait_for(waiting, 1.0)


async def test_load_blind_policies_never_queue():
    registry, (w,), d = fleet("round_robin")
    full(registry, w, running=5, waiting=50)
    async with d.lease(info()) as lease:
        assert lease.worker is w
    assert d.admission.admitted == 0


async def test_a_configured_capacity_gates_before_anything_is_learned():
    """max_num_seqs from the config: the gateway's in-flight count decides "full"; the
    next request waits in the gateway and takes the first slot freed, on either worker."""
    _registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    for w in ws:
        w.max_num_seqs = 2
    release = asyncio.Event()
    order: list = []
    holders = [asyncio.create_task(hold(d, i, order, release)) for i in range(4)]
    await asyncio.sleep(0.01)
    assert [w.inflight for w in ws] == [2, 2] and len(order) == 4
    waiting = asyncio.create_task(hold(d, 9, order, asyncio.Event()))
    await asyncio.sleep(0.01)
    assert d.admission.depth == 1 and d.buckets.sent_to_full == 0
    holders[0].cancel()  # one request ends: its slot takes the waiting one
    await asyncio.sleep(0.01)
    assert d.admission.depth == 0 and order[-1][0] == 9
    assert order[-1][1].worker is order[0][1].worker and order[-1][1].waited > 0
    release.set()
    waiting.cancel()
    await asyncio.gather(*holders, waiting, return_exceptions=True)


async def test_load_blind_policies_count_requests_sent_to_a_full_worker():
    registry, ws, d = fleet("round_robin", (WorkerState.READY,))
    ws[0].max_num_seqs = 1
    async with d.lease(info(0)) as first, d.lease(info(1)) as second:
        assert not first.full and second.full  # round_robin ignores the gate
    assert d.buckets.sent_to_full == 1
    full(registry, ws[0], running=1, waiting=3)  # its queue, as reported
    async with d.lease(info(2)) as third:
        assert third.full
    assert d.buckets.sent_to_full == 2


def chat_info(*turns: str):
    messages = [{"role": "system", "content": "Be brief."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    body = orjson.dumps({"model": "m", "messages": messages})
    return parse_request("/v1/chat/completions", body, "r")


async def test_only_a_cold_prompt_with_nothing_owed_ahead_teaches_the_prefill_rate():
    """A streamed cold prompt's first byte teaches the worker's prefill rate (Lease
    `learns`) only when the worker owes none of this process's prefill ahead of it: the
    bytes it waited for are then its own, known; behind another's, they are a guess."""
    registry, (w,), d = fleet("cache_aware")
    room(registry, w)

    def streamed(text: str):
        body = orjson.dumps({"model": "m", "stream": True, "messages": [
            {"role": "user", "content": text}]})  # fmt: skip
        return parse_request("/v1/chat/completions", body, "r")

    async with d.lease(streamed("q " * 400)) as first:
        assert first.learns and w.backlog == first.pending > 0
        async with d.lease(streamed("another " * 200)) as second:
            assert second.pending > 0 and not second.learns  # behind the first's prefill
        first.first_body(200, first.started + 0.2)
    assert w.backlog == 0 and seconds_per_byte(w) > 0.0  # learned from the first alone
    learned = seconds_per_byte(w)
    async with d.lease(streamed("q " * 400)) as again:  # held there now: not cold
        assert again.pending > 0 and not again.learns
        again.first_body(200, again.started + 0.001)
    assert seconds_per_byte(w) == learned


async def test_going_elsewhere_probes_only_a_worker_the_policy_would_rather_have():
    """Gated at its probing limit, a worker's capacity is probed upward by a request that
    would rather have it (its history is there): the request itself goes there, past the
    guessed limit, up to twice the level; not when going elsewhere costs nothing (a probe
    past a true capacity queues inside the worker), and not past a learned capacity."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    for w in ws:
        room(registry, w)  # scraped, no queue: the gate's probing limit, 8
    async with d.lease(chat_info("the first question")) as lease:
        home = lease.worker
    other = ws[1] if home is ws[0] else ws[0]
    home.inflight = 8  # gated at its probing limit (as if by requests of other clients)
    for doc in (chat_info("another first question"), info()):
        async with d.lease(doc) as lease:
            assert lease.worker is other
        assert not d.buckets.bucket(home).demand  # nothing lost there: no probe
    later = chat_info("the first question", "an answer", "next")
    async with d.lease(later) as lease:
        assert lease.worker is home  # its history's holder, gated by a guess: the probe
    assert d.buckets.bucket(home).demand  # ...and the next scrape may raise the level
    assert d.buckets.capacity_of(home) == 9.0
    home.inflight = 16  # twice the level in flight: no more without a scrape's evidence
    async with d.lease(later) as lease:
        assert lease.worker is other
    home.inflight = 8
    room(registry, home, running=8, waiting=1)  # a queue: its capacity is learned, 8
    async with d.lease(later) as lease:
        assert lease.worker is other  # a learned capacity is not stretched


@pytest.mark.parametrize(("inflight", "others"), [(8, 0.0), (6, 2.0)])
async def test_a_later_turn_takes_the_probe_past_its_holders_limit_and_load_bound(inflight, others):
    """Its history's holder at its probing limit (its own requests, or with another
    replica's at the last scrape, `others`) and past the history's load bound (4 workers,
    the others idle): the gate offers the holder past its limit as the probe, and
    cache_aware takes it, rather than prefill the whole history elsewhere (traced behind
    two replicas: 670-800 uncached tokens, and the requests queued behind that prefill,
    made the TTFT tail)."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 4)
    for w in ws:
        room(registry, w)  # scraped, no queue: the gate's probing limit, 8
    async with d.lease(chat_info("the first question")) as lease:
        home = lease.worker
    home.inflight, home.others = inflight, others
    later = chat_info("the first question", "an answer", "next")
    async with d.lease(later) as lease:
        assert lease.worker is home
    assert d.buckets.capacity_of(home) == 9.0  # the probe, as the gate made it
    assert later.stretched == [home]
    first = chat_info("a new conversation")  # nothing of it held: nothing stretched
    async with d.lease(first):
        assert not first.stretched


async def test_a_worker_stretchable_but_not_chosen_keeps_its_limit():
    """A preferred worker the policy could have had past its limit, but did not choose
    (its own load bound, say), keeps its probing limit: only a request sent there raises it."""

    class Elsewhere:
        name = "elsewhere"
        load_aware = True

        def select(self, candidates, info):
            return next(w for w in candidates if w is not ws[0])

        def preferred(self, gated, candidates, info):
            return list(gated)

        def stretches(self, info):
            return True

    registry, ws, d = fleet("queue", (WorkerState.READY, WorkerState.READY))
    d.policy = Elsewhere()
    for w in ws:
        room(registry, w)
    ws[0].inflight = 8  # at its probing limit
    async with d.lease(info()) as lease:
        assert lease.worker is ws[1]
    assert d.buckets.capacity_of(ws[0]) == 8.0 and not d.buckets.has_token(ws[0])


async def test_a_policy_without_preferences_probes_every_gated_worker_it_went_past():
    """queue has no `preferred`: a gated worker it went past may be the one it would have
    chosen (the faster), so its probing limit grows as before."""
    registry, ws, d = fleet("queue", (WorkerState.READY, WorkerState.READY))
    for w in ws:
        room(registry, w)
    ws[0].inflight = 8  # gated at its probing limit
    async with d.lease(info()) as lease:
        assert lease.worker is ws[1]
    assert d.buckets.bucket(ws[0]).demand


async def _holder_full(d, registry, ws, release):
    """Place a conversation's first turn, then fill its holder (a configured capacity of
    1, held by another request until `release`): (the holder, the other, the holding task)."""
    for w in ws:
        room(registry, w)
    async with d.lease(chat_info("the first question")) as lease:
        home = lease.worker
    other = ws[1] if home is ws[0] else ws[0]
    home.max_num_seqs = 1
    home.kv_binds = True  # its KV cache was seen to bind (kv_queue.py)
    order: list = []
    holding = asyncio.create_task(hold(d, 0, order, release))
    await asyncio.sleep(0)
    assert order and order[0][1].worker is home  # (a request without text: by load)
    return home, other, holding


def _later_turn(d, got: list, later=None) -> asyncio.Task:
    """A later turn of the conversation `_holder_full` placed, leasing in a task: its
    worker and the seconds it waited go to `got`."""

    async def turn():
        async with d.lease(later or chat_info(*LATER)) as lease:
            got.append((lease.worker, lease.waited))

    return asyncio.create_task(turn())


async def test_a_later_turn_waits_for_its_full_holder_and_others_go_past_it():
    """A later turn whose history's holder is full waits in the gateway for it, within its
    patience (one request's time there, 1 / pace), rather than prefill its history
    again elsewhere; a request behind it that prefers nothing goes first, to the worker
    with room; the holder's first freed slot is the later turn's."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.2  # a request takes 5 s there: patience enough for this test
    later = chat_info("the first question", "an answer", "next")
    got: list = []
    waiting = _later_turn(d, got, later)
    await asyncio.sleep(0.02)
    assert not got and d.admission.depth == 1  # it waits (the other worker has room)
    async with d.lease(info(7)) as lease:
        assert lease.worker is other  # past the patient one, to the worker with room
    assert not got
    release.set()  # the holder's slot frees: the later turn takes it
    await holding
    await waiting
    assert got[0][0] is home and got[0][1] > 0.0
    assert d.admission.depth == 0 and home.inflight == 0


async def test_a_patient_request_goes_elsewhere_once_its_patience_is_over():
    """Patience is one request's time on the holder (1 / pace): past it, the next event
    (a scrape here) sends the later turn to the worker with room."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 20.0  # 50 ms
    got: list = []
    waiting = _later_turn(d, got)
    await asyncio.sleep(0.02)
    room(registry, other)  # an event before its patience ends: it still waits
    await asyncio.sleep(0)
    assert not got
    await asyncio.sleep(0.06)
    room(registry, other)  # past it: the worker with room takes it
    await waiting
    assert got[0][0] is other and got[0][1] >= 0.05
    release.set()
    await holding


async def test_without_a_known_pace_a_request_does_not_wait_for_its_holder():
    """Patience comes from the holder's own pace; before one is known (no request
    finished there yet), a later turn goes to the worker with room at once."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.0
    async with d.lease(chat_info("the first question", "an answer", "next")) as lease:
        assert lease.worker is other and lease.waited == 0.0
    release.set()
    await holding


async def test_without_a_learned_prefill_rate_a_turn_does_not_wait_for_a_holder_that_never_bound():
    """Where the KV cache never bound, a later turn waits only when its holder's next slot
    is expected sooner than its history's prefill elsewhere; before any prefill rate is
    learned (no streamed first byte yet), it goes to the worker with room at once."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace, home.kv_binds = 0.2, False
    async with d.lease(chat_info("the first question", "an answer", "next")) as lease:
        assert lease.worker is other and lease.waited == 0.0
    release.set()
    await holding


def _prefills(worker, seconds_per_byte: float) -> None:
    """`worker` was learned to prefill at this rate (prefill_rate.py)."""
    worker.prefill_seconds, worker.prefill_bytes = seconds_per_byte * 1000, 1000.0


async def test_a_later_turn_waits_for_a_slot_on_its_holder_sooner_than_its_prefill_elsewhere():
    """KV cache not binding: the holder (pace 0.2, one request running) frees a slot in
    about 5 s, and the history would take far longer to prefill on the worker with room
    (1 s per byte learned there): the later turn waits, and takes the holder's slot."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace, home.kv_binds = 0.2, False
    _prefills(other, 1.0)
    got: list = []
    waiting = _later_turn(d, got)
    await asyncio.sleep(0.02)
    assert not got and d.admission.depth == 1  # it waits, the other worker has room
    async with d.lease(info(7)) as lease:
        assert lease.worker is other  # past the patient one, to the worker with room
    release.set()  # the holder's slot frees: the later turn takes it
    await holding
    await asyncio.wait_for(waiting, 1.0)
    assert got[0][0] is home and got[0][1] > 0.0


async def test_a_later_turn_goes_elsewhere_when_its_prefill_there_is_sooner_than_a_slot():
    """The same, but the holder frees a slot only every 50 s (pace 0.02) while the worker
    with room prefills fast (1 us per byte): it goes there at once."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace, home.kv_binds = 0.02, False
    _prefills(other, 1e-6)
    async with d.lease(chat_info(*LATER)) as lease:
        assert lease.worker is other and lease.waited == 0.0
    release.set()
    await holding


async def test_a_turn_waits_for_a_slot_no_longer_than_its_prefill_elsewhere_takes():
    """Patience is the prefill elsewhere (here the history's bytes at 2 ms each, over
    0.1 s), at most twice the slot's expected time (pace 20, one running: 50 ms): past
    it, the next event sends the later turn to the worker with room."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY, WorkerState.READY))
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace, home.kv_binds = 20.0, False
    _prefills(other, 2e-3)
    later = chat_info(*LATER)
    t = asyncio.create_task(d.lease(later).__aenter__())
    await asyncio.sleep(0.005)
    assert not t.done() and d.admission.depth == 1
    assert later.saved * 2e-3 > 0.1  # the prefill elsewhere: longer than twice the slot
    for _ in range(20):  # scrapes keep coming; the holder stays full
        await asyncio.sleep(0.02)
        room(registry, other)
        if t.done():
            break
    lease = await asyncio.wait_for(t, 1.0)
    assert lease.worker is other and 0.1 <= lease.waited < 0.5
    d._release(lease)
    release.set()
    await holding


LATER = ("the first question", "an answer", "next")


async def test_patience_is_at_most_half_the_queues_bound():
    """A holder whose requests take 50 s would hold a later turn past `max_queue_wait`
    while another worker has room: patience is capped at half the bound."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 2, max_queue_wait=0.3)
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.02  # 50 s a request
    t = asyncio.create_task(d.lease(chat_info(*LATER)).__aenter__())
    for _ in range(6):  # scrapes keep coming: the other worker has room all along
        await asyncio.sleep(0.06)
        room(registry, other)
    lease = await t
    assert lease.worker is other and 0.15 <= lease.waited < 0.3
    d._release(lease)
    release.set()
    await holding


@pytest.mark.parametrize("out", ["removed", "unhealthy"])
async def test_a_waiter_set_aside_for_a_worker_that_goes_out_goes_on_at_once(out):
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 2)
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.2  # 5 s of patience
    got: list = []

    async def turn():
        async with d.lease(chat_info(*LATER)) as lease:
            got.append(lease.worker)

    task = asyncio.create_task(turn())
    await asyncio.sleep(0.02)
    assert d.admission.depth == 1 and not got
    if out == "removed":
        registry.remove(home.url, "test")
    else:
        registry.set_state(home, WorkerState.UNHEALTHY, "test")
    room(registry, other)  # (any event)
    await asyncio.wait_for(task, 1.0)
    assert got == [other]
    release.set()
    await holding


async def test_a_request_that_cannot_queue_does_not_wait_for_its_holder():
    """`max_queued = 0`: a later turn whose holder is full goes to the worker with room,
    rather than be refused for a queue it need not join."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 2, max_queued=0)
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.2
    async with d.lease(chat_info(*LATER)) as lease:
        assert lease.worker is other
    release.set()
    await holding


async def test_a_waiter_set_aside_does_not_go_before_a_better_priority_in_line():
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 2)
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 0.2
    messages = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(LATER)
    ]
    body = orjson.dumps({"model": "m", "messages": messages})
    low = parse_request("/v1/chat/completions", body, "r", {"x-priority": "5"})
    seq: list[str] = []

    async def go(name, request, stay):
        async with d.lease(request):
            seq.append(name)
            await stay.wait()

    stay = asyncio.Event()
    patient = asyncio.create_task(go("patient", low, stay))
    await asyncio.sleep(0.02)  # set aside for the holder
    other.max_num_seqs = 1
    occupying = asyncio.create_task(go("other", info(50), stay))
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(go("urgent", info(99, priority=-3), stay))
    await asyncio.sleep(0.01)
    assert d.admission.depth == 2 and seq == ["other"]
    release.set()  # the holder frees its slot: the better priority takes it
    await holding
    await asyncio.sleep(0.01)
    assert seq == ["other", "urgent"]
    stay.set()
    await asyncio.wait_for(asyncio.gather(patient, occupying, urgent), 2.0)


async def test_past_its_patience_a_waiter_waits_while_no_worker_with_room_has_kv_blocks():
    """Past its patience a later turn still waits while the worker with room has no free
    KV blocks for its prompt (vLLM would keep it waiting there, and stall those behind
    it); a scrape that shows blocks free lets it go there."""
    registry, ws, d = fleet("cache_aware", (WorkerState.READY,) * 2, max_queue_wait=5.0)
    release = asyncio.Event()
    home, other, holding = await _holder_full(d, registry, ws, release)
    home.pace = 20.0  # 50 ms of patience
    other.kv_free = 0.0  # its KV cache full (as a scrape of a worker whose cache binds)
    got: list = []
    task = _later_turn(d, got)
    await asyncio.sleep(0.1)
    d._serve_queue("m")  # an event past its patience: still no room anywhere
    await asyncio.sleep(0)
    assert not got
    room(registry, other)  # a scrape: the cache not known to bind, room
    await asyncio.wait_for(task, 1.0)
    assert got[0][0] is other and got[0][1] >= 0.1
    release.set()
    await holding
