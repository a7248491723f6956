"""/metrics for the placement feeds (process/placement_feed.py): what was told, applied,
lost and refused, to and from the sibling processes and the peer replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_gateway.observe.exposition import Writer

if TYPE_CHECKING:  # read at scrape time only; built above this module
    from vllm_gateway.process.placement_feed import PlacementFeed

_FEEDS = {  # peers: the family's name, whom its placements are told
    False: ("vllm_gateway_sibling_placements_total", "sibling processes"),
    True: ("vllm_gateway_replica_placements_total", "peer replicas"),
}


def feed_metrics(w: Writer, feed: PlacementFeed, peers: bool = False) -> None:
    """What a feed told the siblings (`peers`: replicas), applied, lost, and refused."""
    name, whom = _FEEDS[peers]
    w.family(
        name,
        "counter",
        f"Lines told to the {whom} (told, once each: a request sent, with its cache_aware "
        "placement if any, or its end), applied from them (applied), lost (dropped: not "
        "told to one away or too slow to read, or a line that failed)"
        + (
            ", connections refused (refused: a wrong token, or a forged or replayed "
            "line), and handshakes with a replica of another feed protocol, either side "
            "(mismatched: another release)."
            if peers
            else "."
        ),
    )
    counts = [("told", feed.sent), ("applied", feed.received), ("dropped", feed.dropped)]
    if peers:
        counts += [("refused", feed.refused), ("mismatched", feed.mismatches)]
    for result, value in counts:
        w.sample(name, value, (("result", result),))
    if peers:
        name = "vllm_gateway_replica_peers_connected"
        w.family(name, "gauge", "Peer replicas this process is connected to now.")
        w.sample(name, feed.connected())
