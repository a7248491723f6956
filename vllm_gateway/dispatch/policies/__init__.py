"""Dispatch policies: one pure module each, and the one table from name to factory.

Code never branches on a policy's name: it looks the name up here. FastChat's controller
names its dispatch methods `lottery` and `shortest_queue`; they are accepted as aliases.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies.base import Policy, PolicyFactory
from vllm_gateway.dispatch.policies.cache_aware import CacheAware
from vllm_gateway.dispatch.policies.least_inflight import LeastInflight
from vllm_gateway.dispatch.policies.power_of_two import PowerOfTwo
from vllm_gateway.dispatch.policies.prefix import PrefixAffinity
from vllm_gateway.dispatch.policies.queue import QueuePolicy
from vllm_gateway.dispatch.policies.random_choice import RandomChoice
from vllm_gateway.dispatch.policies.round_robin import RoundRobin
from vllm_gateway.dispatch.policies.session import SessionAffinity
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker

POLICIES: dict[str, PolicyFactory] = {
    "cache_aware": CacheAware,
    "queue": QueuePolicy,
    "least_inflight": LeastInflight,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "session": SessionAffinity,
    "prefix": PrefixAffinity,
}

ALIASES: dict[str, str] = {
    "shortest_queue": "queue",  # FastChat
    "lottery": "random",  # FastChat (weighted by speed there; by `weight` here)
}


def policy_names() -> list[str]:
    """Every accepted policy name, aliases included."""
    return sorted([*POLICIES, *ALIASES])


def check_policy_name(name: str) -> str | None:
    """Return why `name` is not a policy, or None."""
    if name in POLICIES or name in ALIASES:
        return None
    return f"unknown policy {name!r}; choose one of {', '.join(policy_names())}"


def forget_missing(policies: Iterable[Policy], present: set[Worker]) -> None:
    """Tell the policies that remember workers (cache_aware's index) which are left."""
    for policy in policies:
        forget = getattr(policy, "forget_missing", None)
        if forget is not None:
            forget(present)


def preferred_of(
    policy: Policy, gated: Sequence[Worker], candidates: Sequence[Worker], info: RequestInfo
) -> list[Worker]:
    """Of the workers the gate left out, those `policy` would rather have had for `info`
    than any of the candidates (its optional `preferred`, base.py); all of them when it
    does not say (their capacity is probed, as a request found them full)."""
    hook = getattr(policy, "preferred", None)
    return hook(gated, candidates, info) if hook is not None else list(gated)


def stretches_of(policy: Policy, info: RequestInfo) -> bool:
    """Whether the workers `policy` prefers for `info`, held back only by a guessed limit,
    take it as the probe (its optional `stretches`, base.py); False when it does not say."""
    hook = getattr(policy, "stretches", None)
    return bool(hook(info)) if hook is not None else False


def waits_for_preferred(policy: Policy) -> bool:
    """Whether a request may wait for the full workers `policy` says it prefers (only a
    policy that says which, by its `preferred`: else every full worker would be)."""
    return hasattr(policy, "preferred")


def make_policy(
    name: str, rng: random.Random | None = None, config: DispatchConfig | None = None
) -> Policy:
    """Build the policy called `name` (validated beforehand with `check_policy_name`)."""
    factory = POLICIES[ALIASES.get(name, name)]
    return factory(rng or random.Random(), config or DispatchConfig())


__all__ = [
    "POLICIES",
    "Policy",
    "check_policy_name",
    "forget_missing",
    "make_policy",
    "policy_names",
    "preferred_of",
    "stretches_of",
    "waits_for_preferred",
]
