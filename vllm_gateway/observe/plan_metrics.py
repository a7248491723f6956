"""cache_aware's preamble plans on /metrics: how many were made, and the preambles they moved.

A plan (dispatch/preamble_plan.py) says which workers each popular preamble goes to; a
worker a new plan gives a preamble prefills it, and the histories of the conversations
sent there, so a moves count that keeps rising says the plan churns (shares near a
boundary, workers coming and going). Read at scrape time from the policies' per-model
shares, which a reload that builds new policies starts again (a counter reset).
"""

from __future__ import annotations

from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies.cache_aware import CacheAware
from vllm_gateway.observe.exposition import Writer

# (name, help), in the order of the per-model counts below: plans made, preambles moved.
_FAMILIES = (
    (
        "vllm_gateway_preamble_plans_total",
        "Plans made of which workers each popular preamble (system prompt, shared document) "
        "goes to (cache_aware): on a schedule, and when shares or workers change.",
    ),
    (
        "vllm_gateway_preamble_plan_moves_total",
        "Popular preambles a new plan gave a worker the plan before did not (moved, or one "
        "worker more): each a prefill of the preamble there. The plan's churn.",
    ),
)


def plan_metrics(w: Writer, dispatcher: Dispatcher) -> None:
    """cache_aware's preamble plans per model: made, and the preambles they moved."""
    plans: dict[str, list[int]] = {}
    seen: list[CacheAware] = []  # (a policy may serve several models: count it once)
    for policy in (dispatcher.policy, *dispatcher.policy_for_model.values()):
        if not isinstance(policy, CacheAware) or any(policy is x for x in seen):
            continue
        seen.append(policy)
        for model, shares in policy.shares.items():
            counts = plans.setdefault(model, [0, 0])
            counts[0] += shares.plan.builds
            counts[1] += shares.plan.moves
    for k, (name, help_) in enumerate(_FAMILIES):
        w.family(name, "counter", help_)
        for model, counts in sorted(plans.items()):
            w.sample(name, counts[k], (("model", model),))
