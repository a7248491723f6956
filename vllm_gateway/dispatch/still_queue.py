"""A still queue: a worker's page showing a queue while none of our requests is there.

The token bucket (buckets.py) earns tokens only from what this process's requests finish
and from the room the worker's page shows. A worker whose page shows a queue while this
process has nothing in flight there would get nothing new from it, for as long as the
queue stays, in two cases:

- vLLM updates its gauges when its engine steps, every few milliseconds while it has
  work. After an abort storm (a benchmark client killed, every request ended) its page
  may keep showing a queue with nothing there, until the engine steps again.
- Other senders (another replica of the gateway, a sibling process, clients that go
  around it) keep the queue up. Behind two replicas on workers whose KV cache binds
  (`docchat --kv-wait --replicas 2`), one replica held requests for the worker that
  holds their document 8-13 s, while the other's requests kept its queue from emptying;
  sent at last, their first bytes came in 30 ms.

So a queue shown for `FROZEN_AFTER` seconds while this process had nothing in flight
there (at every scrape) earns the worker one token, once per such period, whether the page
moved or not: that request makes a frozen engine step, or takes this process's turn in a
queue others keep up (with the queue still shown, its end earns less than a token, and
the next comes a period after it ended), or, if the queue is real and stuck, waits in it
alone. A stopped worker (`stop_waiting` or more waiting) earns it only from a page that
stood still, as before: a deep queue that others keep up is no turn of ours.
"""

from __future__ import annotations

# Seconds a queue must stay still, with nothing of ours there, before it earns a token:
# the default `scrape.stale_after`, the age past which a page is no evidence at all.
FROZEN_AFTER = 2.0


class StillQueue:
    """For one worker: since when its page has shown a queue with none of ours there."""

    __slots__ = ("page", "since")

    def __init__(self) -> None:
        self.page = (0.0, 0.0)  # running and waiting as last reported
        self.since: float | None = None  # EngineStats.at of the first such report

    def due(self, running: float, waiting: float, inflight: int, at: float, stopped: bool) -> bool:
        """A new report (at `at`, this process with `inflight` there): whether a token is
        due, the page having shown a queue for `FROZEN_AFTER` seconds, none of ours there
        at any report, moving or not; but a `stopped` worker's (its queue at `stop_waiting`
        or more) only if it has not moved: others keeping a deep queue up is no turn of
        ours. True at most once per period: it starts over."""
        page = (running, waiting)
        moved, self.page = page != self.page, page
        if waiting <= 0 or inflight:
            self.since = None
            return False
        if self.since is None or (stopped and moved):
            self.since = at
            return False
        if at - self.since < FROZEN_AFTER:
            return False
        self.since = at
        return True
