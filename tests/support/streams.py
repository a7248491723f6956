"""Helpers for end-to-end tests that stream through the `openai` SDK and count at the worker."""

from __future__ import annotations

import openai

from vllm_gateway.fake_worker import FakeWorker


async def stream_text(
    c: openai.AsyncOpenAI, max_tokens: int, model: str = "m", prompt: str = "x"
) -> str:
    """Stream one completion and return its text, as a client would assemble it."""
    stream = await c.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def completions_at(worker: FakeWorker) -> int:
    """How many /v1/completions requests a fake worker has received."""
    return sum(1 for r in worker.stats.requests if r.path == "/v1/completions")
