"""A still queue: a worker's page showing the same queue while none of our requests is there.

vLLM updates its gauges when its engine steps, every few milliseconds while it has work.
After an abort storm (a benchmark client killed, every request ended) its page may keep
showing a queue with nothing there, until the engine steps again. The token bucket
(buckets.py) earns tokens only from what the worker finishes and from the room its page
shows, so such a worker would get nothing new, and never step, for good. A queue that has
not moved for `FROZEN_AFTER` seconds while this process had nothing in flight there earns
the worker one token, once per such period: that request makes the engine step and the page
move, or, if the queue is real and stuck, waits in it alone.
"""

from __future__ import annotations

# Seconds a queue must stay still, with nothing of ours there, before it earns a token:
# the default `scrape.stale_after`, the age past which a page is no evidence at all.
FROZEN_AFTER = 2.0


class StillQueue:
    """For one worker: the page's running and waiting counts, and since when they stood."""

    __slots__ = ("page", "since")

    def __init__(self) -> None:
        self.page = (0.0, 0.0)  # running and waiting as last reported
        self.since = 0.0  # EngineStats.at of the first report of them, with none of ours

    def frozen(self, running: float, waiting: float, inflight: int, at: float) -> bool:
        """A new report (at `at`, this process with `inflight` there): whether its queue
        has not moved for `FROZEN_AFTER` seconds, none of ours there all along. True at
        most once per period: it starts over."""
        page = (running, waiting)
        if waiting <= 0 or inflight or page != self.page:
            self.page, self.since = page, at
            return False
        if at - self.since < FROZEN_AFTER:
            return False
        self.since = at
        return True
