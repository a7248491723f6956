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
there earns the worker one token, once per such period, whether the page moved or not:
that request makes a frozen engine step, or takes this process's turn in a queue others
keep up (its end then earns tokens as any finish does), or, if the queue is real and
stuck, waits in it alone.
"""

from __future__ import annotations

# Seconds a queue must stay still, with nothing of ours there, before it earns a token:
# the default `scrape.stale_after`, the age past which a page is no evidence at all.
FROZEN_AFTER = 2.0


class StillQueue:
    """For one worker: since when its page has shown a queue with none of ours there."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None  # EngineStats.at of the first such report

    def frozen(self, waiting: float, inflight: int, at: float) -> bool:
        """A new report (at `at`, `waiting` queued, this process with `inflight` there):
        whether it has shown a queue for `FROZEN_AFTER` seconds, none of ours there all
        along, moving or not. True at most once per period: it starts over."""
        if waiting <= 0 or inflight or self.since is None:
            self.since = None if waiting <= 0 or inflight else at
            return False
        if at - self.since < FROZEN_AFTER:
            return False
        self.since = at
        return True
