"""Token buckets: tokens follow a scripted queue; pace is learned from completions."""

from __future__ import annotations

import math

import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.buckets import PROBE_HOLDOFF, PROBE_START, Buckets
from vllm_gateway.dispatch.still_queue import FROZEN_AFTER
from vllm_gateway.workers import EngineStats, Worker, WorkerRegistry, WorkerState


def setup(stop_waiting: float = 8.0) -> tuple[WorkerRegistry, Worker, Buckets]:
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w", models=("m",))
    registry.set_state(worker, WorkerState.READY, "test")
    buckets = Buckets(DispatchConfig(stop_waiting=stop_waiting))
    registry.stats_listeners.append(buckets.on_stats)
    return registry, worker, buckets


def report(
    registry: WorkerRegistry, worker: Worker, running: float, waiting: float, at: float = 0.0
) -> None:
    """A scrape at time `at` that saw everything the gateway sent and saw finish so far."""
    registry.set_stats(
        worker,
        EngineStats(running, waiting, None, at),
        sent=worker.sent_since_scrape,
        finished=worker.finished_since_scrape,
    )


def send(worker: Worker, buckets: Buckets, n: int = 1) -> None:
    for _ in range(n):
        assert buckets.has_token(worker)
        worker.inflight += 1
        worker.sent_since_scrape += 1
        buckets.take(worker)


def finish(worker: Worker, buckets: Buckets, n: int = 1, seconds: float = 1.0) -> None:
    for _ in range(n):
        worker.inflight -= 1
        worker.finished_since_scrape += 1
        buckets.on_release(worker, seconds, completed=True)


def test_tokens_follow_a_scripted_queue():
    registry, w, b = setup(stop_waiting=8)
    # Never scraped: nothing to go by, the bucket is open.
    assert b.has_token(w)
    # An empty queue, capacity not learned: the probing limit gates what is in flight...
    report(registry, w, running=0, waiting=0)
    send(w, b, int(PROBE_START))
    assert not b.has_token(w) and b.describe(w)["capacity"] == PROBE_START
    # ...admits one more when a scrape shows the worker running it all with no queue while
    # requests wait for it (without demand, more capacity is not worth a probe); a scrape
    # that shows the worker running that one too doubles the level and probes past the
    # new one by an eighth of it (slow start).
    report(registry, w, running=PROBE_START, waiting=0)
    assert b.describe(w)["capacity"] == PROBE_START
    b.note_demand([w])
    report(registry, w, running=PROBE_START, waiting=0)
    assert b.describe(w)["capacity"] == PROBE_START + 1
    send(w, b, 1)
    assert not b.has_token(w) and b.describe(w)["tokens"] is None  # gated, bucket open
    b.note_demand([w])  # requests wait in the gateway: the next level is probed at once
    report(registry, w, running=PROBE_START + 1, waiting=0)
    assert b.describe(w)["capacity"] == 2 * PROBE_START + 2
    send(w, b, int(PROBE_START) + 1)
    assert not b.has_token(w)
    report(registry, w, running=2 * PROBE_START, waiting=0)  # not past the level yet
    assert b.describe(w)["capacity"] == 2 * PROBE_START + 2
    report(registry, w, running=2 * PROBE_START + 1, waiting=0)  # nothing waited since
    assert b.has_token(w) and b.describe(w)["capacity"] == 4 * PROBE_START
    # A queue: it runs all it can (its capacity is learned) and gets nothing more.
    report(registry, w, running=60, waiting=2)
    assert b.by_worker[w].capacity == 60 and not b.has_token(w)
    assert b.by_worker[w].gain == pytest.approx(0.75)
    # Each finish earns 1 - 2/8 = 0.75 token: the queue drains before more is sent.
    tokens = b.by_worker[w].tokens
    finish(w, b, 4)
    assert b.by_worker[w].tokens == pytest.approx(tokens + 3.0)
    # The queue is gone and 4 slots are free: exactly that room, no more.
    report(registry, w, running=56, waiting=0)
    assert b.by_worker[w].tokens == pytest.approx(4.0)
    send(w, b, 4)
    assert not b.has_token(w)
    # Full without a queue, but it queued less than PROBE_HOLDOFF ago: no more.
    report(registry, w, running=60, waiting=0, at=PROBE_HOLDOFF - 0.1)
    assert b.by_worker[w].capacity == 60 and not b.has_token(w)
    # Later, while requests wait for it, capacity is probed upward, 1 then 2 then 3.
    b.note_demand([w])
    report(registry, w, running=60, waiting=0, at=PROBE_HOLDOFF)
    assert b.by_worker[w].capacity == 61
    send(w, b, 1)
    b.note_demand([w])
    report(registry, w, running=61, waiting=0, at=PROBE_HOLDOFF + 0.25)
    assert b.by_worker[w].capacity == 63 and b.by_worker[w].tokens == pytest.approx(2.0)
    # At stop_waiting or more waiting: stopped; finishing requests earn nothing.
    report(registry, w, running=61, waiting=8, at=PROBE_HOLDOFF + 0.5)
    assert not b.has_token(w) and b.by_worker[w].gain == 0.0
    finish(w, b, 10)
    assert not b.has_token(w)
    # A stale snapshot is withdrawn: open again (policies fall back to in-flight).
    registry.set_stats(w, None)
    assert b.has_token(w)


def test_refill_rate_is_pace_times_gain():
    registry, w, b = setup(stop_waiting=4)
    report(registry, w, running=8, waiting=1)
    finish(w, b, 20, seconds=0.5)
    bucket = b.by_worker[w]
    assert bucket.refill_rate == pytest.approx(bucket.completion_rate * 0.75)
    report(registry, w, running=8, waiting=4)
    assert bucket.refill_rate == 0.0


def test_pace_is_learned_from_completions_and_shrugs_off_one_outlier():
    registry, fast, b = setup()
    slow, _ = registry.add("http://slow", models=("m",))
    for _ in range(400):
        finish(fast, b, seconds=1.0)
        finish(slow, b, seconds=2.0)
    assert fast.pace == pytest.approx(1.0) and slow.pace == pytest.approx(0.5)
    finish(fast, b, seconds=600.0)  # one very long request
    assert fast.pace > 0.85
    # Answers that were not completions (errors, departures) teach nothing.
    before = slow.pace
    slow.inflight += 1
    b.on_release(slow, 0.001, completed=False)
    assert slow.pace == before


def test_a_worker_twice_as_fast_earns_twice_the_tokens():
    registry, a, b = setup()
    c, _ = registry.add("http://c", models=("m",))
    for w in (a, c):
        report(registry, w, running=16, waiting=2)
    start = {w: b.by_worker[w].tokens for w in (a, c)}
    finish(a, b, 20)  # in the same time, a finishes twice as many as c
    finish(c, b, 10)
    earned = {w: b.by_worker[w].tokens - start[w] for w in (a, c)}
    assert earned[a] == pytest.approx(2 * earned[c]) and earned[c] > 0


def test_an_unreachable_worker_gets_its_token_back():
    registry, w, b = setup()
    w.inflight = w.sent_since_scrape = 5
    report(registry, w, running=4, waiting=1)  # capacity 4, one over: -1 token
    assert not b.has_token(w)
    for _ in range(2):  # two more were sent, and never reached it (as the dispatcher ends them)
        w.inflight += 1
        w.sent_since_scrape += 1
        b.take(w)
    for _ in range(4):
        w.inflight -= 1
        w.finished_since_scrape += 1
        b.refund(w)
    assert w.inflight == 3 and b.has_token(w)


def test_buckets_of_removed_workers_are_dropped():
    registry, w, b = setup()
    report(registry, w, running=1, waiting=0)
    b.forget_missing(set())
    assert w not in b.by_worker


def test_a_probe_that_only_confirms_the_capacity_doubles_the_holdoff():
    registry, w, b = setup()
    report(registry, w, running=4, waiting=1)  # capacity 4 learned at t=0
    bucket = b.by_worker[w]
    at = PROBE_HOLDOFF
    for expected in (2 * PROBE_HOLDOFF, 4 * PROBE_HOLDOFF):
        b.note_demand([w])
        report(registry, w, running=4, waiting=0, at=at)  # full, no queue: probe 5
        assert bucket.capacity == 5
        report(registry, w, running=4, waiting=1, at=at + 0.25)  # a queue at 4 again
        assert bucket.capacity == 4 and bucket.holdoff == expected
        b.note_demand([w])
        report(registry, w, running=4, waiting=0, at=at + 0.5 + PROBE_HOLDOFF)
        assert bucket.capacity == 4  # not probed before the longer holdoff
        at += 0.25 + expected
    # A probe that finds room resets the holdoff; no probe without demand.
    report(registry, w, running=4, waiting=0, at=at)
    assert bucket.capacity == 4
    b.note_demand([w])
    report(registry, w, running=4, waiting=0, at=at)
    b.note_demand([w])
    report(registry, w, running=5, waiting=0, at=at + 0.25)
    assert bucket.capacity == 7 and bucket.holdoff == PROBE_HOLDOFF


def test_a_configured_capacity_closes_the_gate_without_a_scrape():
    _registry, w, b = setup()
    w.max_num_seqs = 3
    send(w, b, 3)
    assert b.is_full(w) and not b.has_token(w) and b.describe(w)["capacity"] == 3


def test_a_worker_found_full_is_probed_though_its_requests_finished_before_the_scrape():
    """Short requests: the worker was at the probing limit when a request found it full
    (and went to another worker), but by the next scrape some had finished. It ran all it
    was given without a queue, so one more is admitted all the same."""
    registry, w, b = setup()
    report(registry, w, running=0, waiting=0)
    send(w, b, int(PROBE_START))
    assert not b.has_token(w)
    b.note_demand([w], waits=False)  # a request found it full and was sent elsewhere
    finish(w, b, 5)
    report(registry, w, running=3, waiting=0)
    assert b.describe(w)["capacity"] == PROBE_START + 1
    # Without a request finding it full since, the next scrape changes nothing.
    report(registry, w, running=3, waiting=0)
    assert b.describe(w)["capacity"] == PROBE_START + 1


def test_the_level_doubles_only_when_a_scrape_shows_the_worker_running_past_it():
    """The worker runs 8 at most. The request sent past 8 waits inside it a moment, then
    runs when another ends: no scrape shows that queue. The absence of a queue is no
    evidence of room, so the limit stays one past 8 (one request at most in the worker's
    queue) however often it is found full; a scrape with 9 running doubles the level."""
    registry, w, b = setup()
    report(registry, w, running=0, waiting=0)
    send(w, b, int(PROBE_START))
    b.note_demand([w])
    report(registry, w, running=PROBE_START, waiting=0)
    assert b.describe(w)["capacity"] == PROBE_START + 1
    for _ in range(5):
        send(w, b, 1)  # past the level
        assert not b.has_token(w)
        b.note_demand([w])  # found full, at one past the level
        finish(w, b, 1)  # one of the 8 ends; the probe takes its slot
        report(registry, w, running=PROBE_START, waiting=0)
        assert b.describe(w)["capacity"] == PROBE_START + 1
    # A scrape that shows the queue teaches the level as the capacity.
    send(w, b, 1)
    report(registry, w, running=PROBE_START, waiting=1)
    assert b.by_worker[w].capacity == PROBE_START and not b.has_token(w)
    # Another worker runs the 9th: the level doubles.
    registry2, w2, b2 = setup()
    report(registry2, w2, running=0, waiting=0)
    send(w2, b2, int(PROBE_START))
    b2.note_demand([w2])
    report(registry2, w2, running=PROBE_START, waiting=0)
    send(w2, b2, 1)
    report(registry2, w2, running=PROBE_START + 1, waiting=0)  # nothing waited since
    assert b2.describe(w2)["capacity"] == 2 * PROBE_START


def test_a_learned_capacity_is_not_probed_when_the_request_found_room_elsewhere():
    """A learned capacity is what the worker runs before queueing: probing past it while
    another worker had room would queue a request inside this one (behind long answers,
    say) for nothing. Only a request that waits probes it."""
    registry, w, b = setup()
    report(registry, w, running=4, waiting=1)  # learned: it runs 4
    assert b.by_worker[w].capacity == 4
    report(registry, w, running=4, waiting=0, at=PROBE_HOLDOFF)
    b.note_demand([w], waits=False)
    report(registry, w, running=4, waiting=0, at=PROBE_HOLDOFF + 0.25)
    assert b.by_worker[w].capacity == 4
    b.note_demand([w])  # one waited for it
    report(registry, w, running=4, waiting=0, at=PROBE_HOLDOFF + 0.5)
    assert b.by_worker[w].capacity == 5


def test_a_large_level_is_probed_by_an_eighth_and_confirmed_by_any_of_it_running():
    """At level 64 a probe admits 8 more; a scrape that catches any of them running (65
    or more) doubles the level and probes past it by 16, and one that shows still more
    running jumps to that. A queue at 0 running teaches nothing: back to the level."""
    registry, w, b = setup()
    bucket = b.bucket(w)
    bucket.probe_limit = 64.0
    report(registry, w, running=0, waiting=0)
    send(w, b, 64)
    b.note_demand([w])
    report(registry, w, running=64, waiting=0)
    assert b.describe(w)["capacity"] == 72
    send(w, b, 8)
    b.note_demand([w])
    report(registry, w, running=65, waiting=0)
    assert b.describe(w)["capacity"] == 144
    b.note_demand([w])
    report(registry, w, running=128, waiting=0)  # the level itself: no evidence of room
    assert b.describe(w)["capacity"] == 144
    report(registry, w, running=300, waiting=0)  # e.g. other clients' requests
    assert b.describe(w)["capacity"] == 300  # nothing waited: no probe past it yet
    b.note_demand([w])
    report(registry, w, running=300, waiting=0)
    assert b.describe(w)["capacity"] == 337
    report(registry, w, running=0, waiting=3)
    assert bucket.capacity is None and b.describe(w)["capacity"] == 300


def test_a_worker_whose_gauge_does_not_count_the_requests_is_ramped_by_what_it_was_given():
    """A server that always reports 0 running (not vLLM, a proxy, a broken page) gives no
    evidence of room by what it runs: the level doubles by what the gateway gave it, as
    when nothing better is known, instead of waiting forever for `running` to pass it."""
    registry, w, b = setup()
    report(registry, w, running=0, waiting=0)
    limits = []
    for _ in range(4):
        while b.has_token(w):
            send(w, b)
        b.note_demand([w])
        report(registry, w, running=0, waiting=0)
        limits.append(b.describe(w)["capacity"])
    assert limits == [16, 32, 64, 128]


def stretch(w: Worker, b: Buckets) -> None:
    """What _pick does for a request chosen past its probing limit: stretch, then send."""
    assert b.can_stretch(w) and not b.has_token(w)
    b.stretch(w)
    send(w, b)


def test_a_preferred_request_stretches_a_guessed_limit_up_to_twice_the_level():
    """`stretch`: past the probing limit by one request at a time, for a request the policy
    would rather send there, up to twice the level (the next slow-start level); a scrape
    showing the worker running past the level then doubles it. Never for a configured or
    learned capacity, a worker reporting a queue, or one never scraped."""
    registry, w, b = setup()
    assert not b.can_stretch(w)  # never scraped: the gate is open anyway
    report(registry, w, running=0, waiting=0)
    send(w, b, int(PROBE_START))
    for n in range(int(PROBE_START)):  # one more each time, to twice the level
        stretch(w, b)
        assert b.capacity_of(w) == PROBE_START + n + 1
    assert not b.can_stretch(w) and not b.has_token(w)
    report(registry, w, running=PROBE_START + 1, waiting=0)  # it ran past the level
    assert b.capacity_of(w) == 2 * PROBE_START  # the next level (and nothing waited)
    report(registry, w, running=2 * PROBE_START, waiting=2)  # a queue: learned
    assert b.capacity_of(w) == 2 * PROBE_START and not b.can_stretch(w)
    finish(w, b, 2 * int(PROBE_START) - 1)
    report(registry, w, running=1, waiting=0)  # learned, and no queue now: not stretched
    send(w, b, 2 * int(PROBE_START) - 1)
    assert not b.has_token(w) and not b.can_stretch(w)


def test_a_stretch_without_evidence_falls_back_to_the_usual_probe():
    """A scrape that does not show the worker running past the level brings a stretched
    limit back to the level plus one probe: it was for the requests that wanted it."""
    registry, w, b = setup()
    report(registry, w, running=0, waiting=0)
    send(w, b, int(PROBE_START))
    for _ in range(4):
        stretch(w, b)
    assert b.capacity_of(w) == PROBE_START + 4
    finish(w, b, 6)
    report(registry, w, running=PROBE_START - 2, waiting=0)
    assert b.capacity_of(w) == PROBE_START + 1


def test_a_queue_or_a_configured_capacity_is_never_stretched():
    registry, w, b = setup()
    report(registry, w, running=PROBE_START, waiting=1)  # a queue: capacity learned
    assert not b.can_stretch(w)
    registry2, w2, b2 = setup()
    report(registry2, w2, running=0, waiting=0)
    w2.max_num_seqs = 4
    send(w2, b2, 4)
    assert not b2.can_stretch(w2) and not b2.has_token(w2)
    # A stretch that ends in a queue goes back to the level, as a probe does.
    registry3, w3, b3 = setup()
    report(registry3, w3, running=0, waiting=0)
    send(w3, b3, int(PROBE_START))
    stretch(w3, b3)
    report(registry3, w3, running=PROBE_START - 1, waiting=2)
    assert b3.capacity_of(w3) == PROBE_START - 1 and not b3.can_stretch(w3)


def test_two_replicas_gate_on_the_workers_whole_load():
    """Two gateways started separately (each its own registry and buckets) in front of one
    worker that runs 4 at once: each gates on the worker's load as its scrape reports it
    (the other's requests included), corrected by its own sends since, so together they
    fill the worker once, not twice. Configured, learned and guessed capacities alike."""
    for how in ("configured", "learned", "guessed"):
        (ra, a, ba), (rb, b, bb) = setup(), setup()
        for registry, w, buckets in ((ra, a, ba), (rb, b, bb)):
            if how == "configured":
                w.max_num_seqs = 4
                report(registry, w, running=0, waiting=0)
            elif how == "learned":
                report(registry, w, running=4, waiting=1)  # capacity 4
                report(registry, w, running=0, waiting=0)
            else:
                report(registry, w, running=0, waiting=0)
                buckets.by_worker[w].probe_limit = 4.0
                registry.set_stats(w, w.stats)  # Worker.capacity follows the limit
        send(a, ba, 3)
        report(rb, b, running=3, waiting=0)  # b's scrape sees a's three running
        assert bb.has_token(b), how
        send(b, bb, 1)
        assert bb.is_full(b) and not bb.has_token(b), how  # 3 of a's + its own one
        assert bb.can_stretch(b) == (how == "guessed"), how  # a guess, up to twice the level
        report(ra, a, running=4, waiting=0)  # a's own three and b's one
        assert ba.is_full(a) and not ba.has_token(a), how
        finish(a, ba, 1)  # one of its own finished since: a slot is free
        assert ba.has_token(a), how
        # Without a fresh scrape, each has only its own count to go by.
        ra.set_stats(a, None)
        assert not ba.is_full(a), how


def test_a_replicas_stretch_counts_the_other_replicas_requests():
    """The stretch goes up to twice the level by the worker's whole load, not by one
    replica's in-flight count."""
    ra, a, ba = setup()
    report(ra, a, running=0, waiting=0)
    send(a, ba, 2)
    report(ra, a, running=2 * PROBE_START - 2, waiting=0)  # the other sent the rest
    for _ in range(2):  # to 15, then 16 by the whole load (its own: 3, then 4)
        stretch(a, ba)
    assert a.inflight == 4 and ba.capacity_of(a) == 2 * PROBE_START
    assert not ba.can_stretch(a)


def test_others_are_what_a_scrape_counts_beyond_this_process():
    """`Worker.others`: what the page reports running and waiting beyond the most of this
    process's requests it may count (`own`; by default its in-flight count now)."""
    registry, w, _b = setup()
    w.inflight = 3
    registry.set_stats(w, EngineStats(5, 1, None, 0.0), own=4)
    assert w.others == 2
    registry.set_stats(w, EngineStats(2, 0, None, 0.0))  # fewer than its own: none
    assert w.others == 0
    registry.set_stats(w, EngineStats(4, 1, None, 0.0))
    assert w.others == 2
    registry.set_stats(w, None)  # stale: nothing known of others either
    assert w.others == 0


def test_a_frozen_page_never_keeps_a_process_from_sending_one_request():
    """vLLM updates its gauges only when its engine steps: after every request ended
    (aborted), its page may keep saying 256 running. Counted as others' requests, they
    would fill the gate for good, and the idle worker would never step to correct it; a
    process with nothing in flight may always send one."""
    registry, w, b = setup()
    w.max_num_seqs = 256
    w.inflight = w.sent_since_scrape = 256
    report(registry, w, running=256, waiting=0)
    finish(w, b, 256)  # the client left: every lease ended, and the page froze
    for at in range(3):
        registry.set_stats(w, EngineStats(256, 0, None, float(at)), own=0)
    assert w.others == 256 and b.has_token(w) and not b.is_full(w)
    send(w, b)
    assert b.is_full(w) and not b.has_token(w)  # one at a time until the page moves


def test_a_queue_frozen_on_the_page_earns_one_token_at_a_time():
    """After an abort storm vLLM's page may keep showing a queue until its engine steps
    again: nothing this process finishes there earns a token, so a queue that has not
    moved for FROZEN_AFTER seconds, with nothing of ours in flight, earns one."""
    registry, w, b = setup()
    w.max_num_seqs = 256
    for at in (0.0, 1.0):
        report(registry, w, running=250, waiting=6, at=at)
        assert not b.has_token(w)
    report(registry, w, running=250, waiting=6, at=FROZEN_AFTER)
    assert b.has_token(w)
    send(w, b)
    report(registry, w, running=250, waiting=6, at=FROZEN_AFTER + 0.25)
    assert not b.has_token(w)  # one of ours there: it waits for that one
    finish(w, b)
    report(registry, w, running=250, waiting=6, at=FROZEN_AFTER + 0.5)
    assert not b.has_token(w)  # the still period starts over
    report(registry, w, running=250, waiting=6, at=2 * FROZEN_AFTER)
    assert not b.has_token(w)
    report(registry, w, running=250, waiting=6, at=2 * FROZEN_AFTER + 0.5)
    assert b.has_token(w)


def test_a_process_with_nothing_on_a_worker_others_keep_queued_gets_one_request_a_period():
    """Another replica (or sibling process, or direct client) keeps a worker's queue up
    (a KV cache that binds: its page shows a queue at every scrape, never the same).
    This process, with nothing in flight there, earns nothing from finishes: before, it
    held requests for the worker 8-13 s (docchat --kv-wait behind two replicas). Now a
    queue shown for FROZEN_AFTER with none of ours there earns one token, moving or not;
    that request's end earns as any finish does."""
    registry, w, b = setup()
    at = 0.0
    tokens_at = []
    while at <= 3 * FROZEN_AFTER:
        waiting = 1 + int(at * 4) % 3  # others' requests come and go: the page moves
        report(registry, w, running=3 + waiting, waiting=waiting, at=at)
        if b.has_token(w):
            tokens_at.append(at)
            send(w, b)
            report(registry, w, running=3 + waiting, waiting=waiting, at=at + 0.1)
            assert not b.has_token(w)  # one of ours there: it waits for that one
            finish(w, b)
            at += 0.1
        at += 0.25
    # The first after one period of queue, the next a period after ours ended (not one a
    # scrape): 2.0 and 4.6 s here.
    assert len(tokens_at) == 2, tokens_at
    assert tokens_at[0] >= FROZEN_AFTER
    assert tokens_at[1] >= tokens_at[0] + 0.1 + FROZEN_AFTER  # a period after ours ended


def test_a_stopped_worker_others_keep_queued_gets_nothing_unless_its_page_stands_still():
    """A queue at stop_waiting or more that others keep moving is no turn of ours: the
    worker stays stopped for this process, as before; a page that stands still still
    earns one (the abort storm)."""
    registry, w, b = setup(stop_waiting=8)
    for i in range(4 * int(FROZEN_AFTER / 0.25)):
        report(registry, w, running=10, waiting=8 + i % 3, at=i * 0.25)  # moving
        assert not b.has_token(w)
    at = 4 * FROZEN_AFTER
    report(registry, w, running=10, waiting=9, at=at)
    report(registry, w, running=10, waiting=9, at=at + FROZEN_AFTER / 2)
    assert not b.has_token(w)
    report(registry, w, running=10, waiting=9, at=at + FROZEN_AFTER)
    assert b.has_token(w)  # stood still a period: frozen


@pytest.mark.parametrize(
    ("usage", "cache_tokens", "largest_body", "learned"),
    [
        (0.1, 10_000.0, 4_000, 3.0),  # 9000 tokens free, a 1000-token prompt fits: batch
        (0.9, 10_000.0, 8_000, None),  # 1000 free, 2000 needed: its KV cache, no batch size
        (0.9, 10_000.0, 2_000, 3.0),  # 1000 free, 500 needed: the batch
        (None, None, 8_000, 3.0),  # no cache reported: a queue is the batch's
    ],
)
def test_a_queue_the_kv_cache_may_cause_teaches_no_capacity(
    usage: float | None, cache_tokens: float | None, largest_body: int, learned: float | None
) -> None:
    """vLLM keeps a request waiting when its prompt's blocks do not fit, whatever its batch
    has free: what it runs then is no batch size (bytes per token: 4 until measured)."""
    registry, w, b = setup()
    registry.set_stats(w, EngineStats(0, 0, usage, 0.0, cache_tokens))
    w.inflight += 4
    w.sent_since_scrape += 4
    for size in (100, largest_body, 100, 100):
        b.take(w, True, size)
    registry.set_stats(w, EngineStats(3, 1, usage, 0.25, cache_tokens), sent=4)
    assert b.by_worker[w].capacity == learned
    assert not b.has_token(w)  # either way it has no room now


def test_a_kv_bound_queue_takes_the_tokens_a_known_capacity_would_give():
    registry, w, b = setup()
    report(registry, w, running=0, waiting=0)
    send(w, b, 8)
    report(registry, w, running=7, waiting=1, at=0.25)  # learned: 7
    finish(w, b, 8)
    report(registry, w, running=0, waiting=0, at=0.5)
    assert b.by_worker[w].capacity == 7 and b.has_token(w)
    b.take(w, True, 40_000)  # a long prompt: 10000 tokens at 4 bytes each
    registry.set_stats(w, EngineStats(2, 3, 0.5, 0.75, 16_000.0), sent=1)
    # 8000 tokens free: the oldest waiter may need more. Room for 7 - 2 - 3 by the batch,
    # but none while the worker keeps requests waiting; the capacity stays 7.
    assert b.by_worker[w].capacity == 7 and not b.has_token(w)


def test_the_largest_body_counts_from_when_it_was_sent():
    """A long prompt sent just before a queue makes it KV-bound however long the quiet
    before; one sent an hour before no longer does."""
    registry, w, b = setup()
    registry.set_stats(w, EngineStats(0, 0, 0.5, 0.0, 16_000.0))
    b.take(w, True, 40_000)  # 10000 tokens, more than the 8000 free
    registry.set_stats(w, EngineStats(1, 0, 0.5, 0.25, 16_000.0), sent=1)
    registry.set_stats(w, EngineStats(2, 1, 0.5, 3600.0, 16_000.0))
    assert b.by_worker[w].capacity == 2  # an hour on: a batch's queue
    registry.set_stats(w, EngineStats(0, 0, 0.5, 3700.0, 16_000.0))
    b.take(w, True, 40_000)
    registry.set_stats(w, EngineStats(1, 1, 0.5, 3700.25, 16_000.0), sent=1)
    assert b.by_worker[w].capacity == 2  # just sent: the KV cache's, nothing learned


@pytest.mark.parametrize(
    ("scrapes", "binds", "free"),
    [
        # (running, waiting, usage) per scrape; the cache holds 16000 tokens; a 40000-byte
        # prompt (10000 tokens) was sent before each.
        ([(8, 0, 0.5), (3, 2, 0.9)], True, 1600.0),  # a queue at 3 after running 8: the KV's
        ([(8, 0, 0.5), (3, 2, 0.9), (1, 0, 0.25)], True, 12000.0),  # ...and stays known
        ([(8, 0, 0.5), (8, 2, 0.75)], False, 4000.0),  # a queue at its most: the batch's
        ([(8, 0, 0.5), (7, 2, 0.75)], False, 4000.0),  # a scrape a request short: still
        # Read full with no queue (over-committing, it admits): nothing said of room...
        ([(8, 0, 0.5), (9, 0, 1.0)], False, math.inf),
        ([(8, 0, 0.5), (8, 2, 1.0)], False, 0.0),  # ...full with a queue: none...
        ([(8, 0, 0.5), (3, 2, 1.0)], True, 0.0),  # ...and full where it binds: none
        ([(8, 0, 0.1), (3, 2, 0.1)], False, 14400.0),  # room for the prompt: not the KV's
        ([(8, 0, 0.5)], False, 8000.0),  # no queue yet: its free blocks count all the same
        ([(8, 0, None), (3, 2, None)], False, math.inf),  # no cache reported
    ],
)
def test_a_worker_whose_kv_cache_binds_is_told_from_one_whose_batch_does(
    scrapes: list[tuple[float, float, float | None]], binds: bool, free: float
) -> None:
    """vLLM keeps requests waiting for KV blocks while it runs fewer than its batch holds;
    a full batch queues at its most. Only a worker seen doing the first is marked binding
    (the admission queue's patience reads it); every worker that reports its cache has its
    free KV blocks counted (`Worker.kv_free`, tokens) for placement from its first scrape
    (docs/dispatch.md "No copy into a full KV cache"), as vLLM makes a prompt wait for
    blocks from its first request on; but not a cache read full with no queue while not
    binding (an engine that over-commits or preempts reads 1.0 while it admits)."""
    registry, w, b = setup()
    for i, (running, waiting, usage) in enumerate(scrapes):
        b.take(w, True, 40_000)
        cache = 16_000.0 if usage is not None else None
        registry.set_stats(w, EngineStats(running, waiting, usage, 0.25 * i, cache))
    assert w.kv_binds is binds
    assert w.kv_free == pytest.approx(free)
    registry.set_stats(w, None)  # stale: nothing known
    assert w.kv_free == math.inf


@pytest.mark.parametrize(
    ("after", "binds"),
    [
        # The scrapes after the KV queue, as (cache size, prompt tokens, requests done).
        ([(16_000.0, 9_000.0, 40.0)], True),  # the same engine, counters on: still binding
        ([(16_000.0, 100.0, 1.0)], False),  # counters back to near 0: a restart
        ([(16_000.0, 100.0, 40.0)], False),  # one counter back is enough
        ([(16_000.0, None, 40.0)], True),  # a page missing a counter: nothing learned
        ([(32_000.0, 9_000.0, 40.0)], False),  # a cache of another size: another engine
        ([(None, 9_000.0, 40.0)], True),  # a page missing the cache size: nothing learned
        ([(None, 9_000.0, 40.0), (32_000.0, 9_001.0, 41.0)], False),  # ...then another size
    ],
)
def test_a_restarted_worker_is_learned_anew_not_kept_binding(
    after: list[tuple[float | None, float | None, float]], binds: bool
) -> None:
    """`kv_binds` is about one engine: a worker that restarts (its counters go back) or
    comes back with another cache size is no longer taken as binding (the admission
    queue's patience waits for it no longer) until its own queues say so again; and the
    most it was seen running is the new engine's, so a short queue right after the
    restart (its batch not seen full yet) does not mark it again."""
    registry, w, b = setup()
    for i, (running, waiting, usage) in enumerate([(8, 0, 0.5), (3, 2, 0.9)]):
        b.take(w, True, 40_000)
        registry.set_stats(
            w,
            EngineStats(
                running,
                waiting,
                usage,
                0.25 * i,
                16_000.0,
                prompt_tokens=8_000.0 + i,
                requests_done=30.0 + i,
            ),
        )
    assert w.kv_binds
    at = 0.5
    for cache, tokens, done in after:
        registry.set_stats(
            w, EngineStats(1, 0, 0.25, at, cache, prompt_tokens=tokens, requests_done=done)
        )
        at += 0.25
    assert w.kv_binds is binds
    # Free blocks counted whenever the page gives the cache's size, binding or not.
    assert (w.kv_free < math.inf) is (after[-1][0] is not None)
    b.take(w, True, 40_000)  # one queued at its new most (1): its batch's, not the KV's
    registry.set_stats(
        w,
        EngineStats(
            1, 2, 0.95, at, after[-1][0] or 16_000.0, prompt_tokens=9_500.0, requests_done=50.0
        ),
    )
    assert w.kv_binds is binds


def test_a_restarted_worker_has_its_capacity_learned_anew() -> None:
    """A capacity learned from the old engine's queue (4 here) is not the new one's (it
    may run a larger batch): after a restart the gate starts from its probing limit again,
    as for a worker never seen queueing. The same engine keeps what was learned."""
    for restart in (False, True):
        registry, w, b = setup()
        registry.set_stats(w, EngineStats(4, 2, None, 0.0, prompt_tokens=900.0, requests_done=9))
        assert b.describe(w)["capacity"] == 4  # learned from its queue
        tokens = 10.0 if restart else 1_000.0  # its prompt-token counter went back, or not
        registry.set_stats(w, EngineStats(0, 0, None, 0.25, prompt_tokens=tokens, requests_done=9))
        assert b.describe(w)["capacity"] == (PROBE_START if restart else 4)
