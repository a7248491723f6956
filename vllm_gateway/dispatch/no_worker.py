"""The answer for a request no available worker can take: 404 for a model no worker
serves, 503 (with `Retry-After`) for one whose workers are all out (a known model is never
a 404), or none: it waits in the admission queue (the model scales from zero)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.errors import GatewayError, ModelNotFound, NoWorkerAvailable
from vllm_gateway.workers import Worker, WorkerRegistry


def without_worker(
    info: RequestInfo,
    serving: Sequence[Worker],
    exclude: Sequence[Worker],
    registry: WorkerRegistry,
    scales_from_zero: Collection[str],
) -> GatewayError | None:
    """The error for `info`, whose model's workers (`serving`) are all out or `exclude`d
    (tried already); None when the model scales from zero: it waits for a worker."""
    if info.model in scales_from_zero:
        return None
    if not serving:
        return ModelNotFound(_unknown_model_message(info.model, registry), param="model")
    return NoWorkerAvailable(
        f"No worker serving `{info.model}` is available right now "
        f"({len(serving)} known, none ready{' untried' if exclude else ''})."
    )


def _unknown_model_message(model: str, registry: WorkerRegistry) -> str:
    known = registry.known_models()
    listed = ", ".join(known[:20]) + (" …" if len(known) > 20 else "")
    return (
        f"The model `{model}` does not exist on this gateway. Available models: {listed or 'none'}."
    )
