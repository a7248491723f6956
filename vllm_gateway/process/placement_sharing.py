"""Wiring the placement feeds (placement_feed.py) to a process's dispatcher.

    share_placements(dispatcher, registry, siblings, peers) -> (sibling feed, peer feed)
    peer_feed(config.replicas, ident, reuse_port)             makes the peers' feed
    feeds_lifetime(siblings, feed)                            an app cleanup_ctx

What a process tells (each request it sends, with its cache_aware placement if any, and
each request's end) and what it does with what it is told (the request counted on its
worker while it runs, the placement recorded in the policy's index and shares), for the
sibling processes of `serve --processes N` and the peer replicas of `[replicas]` alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from aiohttp import web

from vllm_gateway.config.replicas import ReplicasConfig, parse_address
from vllm_gateway.dispatch.buckets import PROBE_START
from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.lease import Lease
from vllm_gateway.dispatch.policies import Policy
from vllm_gateway.dispatch.policies.cache_aware import CacheAware
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.process.feed_handshake import Hello
from vllm_gateway.process.placement_feed import Apply, PlacementFeed
from vllm_gateway.process.siblings import Siblings
from vllm_gateway.workers import Worker, WorkerRegistry

Lifetime = Callable[[web.Application], AsyncIterator[None]]

# `shared` values that are no count of a cache_aware placement (those are >= -1):
LOAD = -3  # a request sent to the worker, nothing to record (no blocks, another policy)
DONE = -2  # a request told before ended
# Told requests count on a worker up to this many times its capacity (as the gate knows it,
# else PROBE_START): past its capacity a worker is full whatever the figure, and a peer
# that tells starts and no ends (a bug, a lost link) moves the load view only so far.
OTHERS_SPAN = 4.0


def peer_feed(
    replicas: ReplicasConfig, ident: str, reuse_port: bool
) -> Callable[[Apply], PlacementFeed]:
    """What makes the feed to the peer replicas `replicas` names (validated: its addresses
    parse), for the replica with id `ident` (its processes share it); `reuse_port`: every
    process of this replica listens on the port."""
    listen = parse_address(replicas.listen) if replicas.listen else None
    peers = [parse_address(p) for p in replicas.peers]
    hello = Hello(replicas.token, ident)
    return lambda apply: PlacementFeed(listen, peers, apply, hello=hello, reuse_port=reuse_port)


def share_placements(
    dispatcher: Dispatcher,
    registry: WorkerRegistry,
    siblings: Callable[[Apply], PlacementFeed] | None,
    peers: Callable[[Apply], PlacementFeed] | None,
) -> tuple[PlacementFeed | None, PlacementFeed | None]:
    """Tell the siblings (`serve --processes N`) and the peer replicas (`[replicas]`) each
    request `dispatcher` sends and when it ends, with what a cache_aware policy placed;
    count theirs on their workers and record their placements in the same policy's index
    here (the worker by its URL: each process has its own Worker objects for the same
    workers). `siblings(apply)` and `peers(apply)` make the feeds (None: that feed is off);
    the two made are returned. A peer's placement reaches one process of this replica (its
    connection's), which tells its siblings too.

    The count is `Worker.others`, which the capacity gate adds to this process's own
    requests: a scrape sets it from the worker's page every 250 ms (its running and waiting
    requests less this process's); told, it follows the others' requests as they go out and
    end in between, so two senders seldom both fill a worker's last slots between two
    scrapes (the blind window: each counted only its own). The next successful scrape sets
    it from the page again, which also undoes a lost or late message."""

    apply = _applier(dispatcher, registry)
    sibling_feed = siblings(apply) if siblings is not None else None

    def from_peer(model: str, url: str, shared: int, preamble: int, names: Sequence[int]) -> None:
        apply(model, url, shared, preamble, names)
        if sibling_feed is not None:
            sibling_feed.publish(model, url, shared, preamble, names)

    peer_feed = peers(from_peer) if peers is not None else None
    publishers = [f.publish for f in (sibling_feed, peer_feed) if f is not None]
    if not publishers:
        return sibling_feed, peer_feed

    _tell(dispatcher, publishers)
    return sibling_feed, peer_feed


def _applier(dispatcher: Dispatcher, registry: WorkerRegistry) -> Apply:
    """What is done with a sibling's or peer's line (the worker by its URL): a request
    counted on its worker (`Worker.others`, at most `OTHERS_SPAN` x its capacity) until its
    end is told; its placement counted and recorded as if made here, by the model's
    cache_aware policy. An end that opens the worker's capacity gate serves the admission
    queue (only then: a peer decides how often ends come)."""
    is_full = dispatcher.buckets.is_full

    def apply(model: str, url: str, shared: int, preamble: int, names: Sequence[int]) -> None:
        worker = registry.get(url)
        if shared == DONE:
            if worker is not None and worker.others >= 1.0:
                full = is_full(worker)
                worker.others -= 1.0
                if full and not is_full(worker):
                    dispatcher.room_opened(worker)
            return
        if worker is not None:
            most = OTHERS_SPAN * (worker.max_num_seqs or worker.capacity or PROBE_START)
            if worker.others < most:  # (a page's larger figure stands)
                worker.others = min(most, worker.others + 1.0)
        if shared == LOAD:
            return
        policy = dispatcher.policy_for_model.get(model, dispatcher.policy)
        if isinstance(policy, CacheAware):  # (a worker not known here yet is still counted)
            policy.told(model, worker, shared, preamble, names)

    return apply


def _tell(dispatcher: Dispatcher, publishers: list[Callable[..., None]]) -> None:
    """Hook `dispatcher` so each request sent is told (with what cache_aware placed), and
    its end (`DONE`) when its lease is released. A worker only named (`choose`: FastChat's
    /get_worker_address, no lease here) is told as placed and ended at once: its placement
    recorded, nothing left counted."""

    def placed(policy: Policy, info: RequestInfo, worker: Worker, leased: bool = True) -> None:
        told = False
        if isinstance(policy, CacheAware):
            blocks = info.prefix_blocks()  # (computed once, by the policy's select)
            if blocks is not None:
                shared = policy.shared if policy.new else -1  # (-1: not counted again)
                for publish in publishers:
                    publish(info.model, worker.url, shared, blocks.preamble, blocks.blocks)
                told = True
        if not told and leased:
            for publish in publishers:
                publish(info.model, worker.url, LOAD, 0, ())
        elif told and not leased:
            for publish in publishers:
                publish(info.model, worker.url, DONE, 0, ())

    def released(lease: Lease) -> None:
        for publish in publishers:
            publish(lease.info.model, lease.worker.url, DONE, 0, ())

    dispatcher.on_placed = placed
    dispatcher.on_release.append(released)


def feeds_lifetime(siblings: Siblings | None, feed: PlacementFeed | None) -> Lifetime:
    """The sibling processes' control sockets and placement feed, or (`siblings` None) the
    feed to the peer replicas: open while the app runs."""

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        if siblings is not None:
            await siblings.open()
        if feed is not None:
            await feed.open()
        yield
        if feed is not None:
            await feed.close()
        if siblings is not None:
            await siblings.close()

    return lifetime
