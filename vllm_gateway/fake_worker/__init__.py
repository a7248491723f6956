"""A vLLM stand-in: OpenAI wire format, /metrics, continuous batching, prefix cache, faults.

    worker = FakeWorker(FakeWorkerConfig(models=("m",), max_num_seqs=4))
    await worker.start()            # 127.0.0.1, free port -> worker.url
    ...                             # worker.stats counts what happened
    await worker.stop()

Token i of every answer is " w{i}". A client that goes away is counted in
`stats.aborted` and its batch slot is freed at once. It answers in vLLM's shapes:
completions and chat with `n` choices (each event of a stream carries one, with its
`index`) and `logprobs` (chat: `logprobs` + `top_logprobs`; completions: `logprobs: k`),
`/v1/responses` (OpenAI's Responses API, streamed with `event:` lines), embeddings,
score, rerank, tokenize; a body that fails vLLM's schema is a 400 worded as FastAPI words
it ("Input should be a valid list", "Field required").

A prompt is one token per word (tokens.py). Its blocks of `block_size` tokens go
through a prefix cache of `num_gpu_blocks` blocks (prefix_cache.py: chained block
hashes, pinning, LRU eviction), reported as vLLM does (vllm:prefix_cache_queries/hits,
vllm:kv_cache_usage_perc, vllm:cache_config_info). Time to first token is the prompt's
uncached tokens x `prefill_ms_per_token` on the worker's one prefill lane, then
`ttft_ms` (prefill.py). Defaults: no capacity limit and free prefill, as before.

Faults act on the model endpoints (POST /v1/*, /tokenize, ...), never on /health,
/metrics, /v1/models or /fake/*. They are chosen worker-wide (config.fault,
set_fault(), POST /fake/fault {"fault": NAME|null}) or per request with the header
`X-Fake-Fault: NAME` or `NAME=PARAM` ("none" opts one request out); an unknown name
is a 400. K counts SSE events, chat's role event included; a non-streamed body is
cut after its first half instead.

    hang               read the request, never answer
    stall_headers=S    wait S seconds, then answer normally (no S: forever)
    stall_midstream=K  send K events, then nothing (the request keeps its slot)
    reset_midstream=K  send K events, then abort the TCP connection with a RST
    close_midstream=K  send K events, then end the chunked body cleanly, no [DONE]
    status=CODE        answer CODE (400-599) with an OpenAI error; Retry-After: 1 on 429/503
    drip=MS            write the body 4 bytes at a time, MS ms apart (default 10)
    malformed_sse      events that are neither JSON nor SSE (half a body if not streamed)
    huge_event=BYTES   one extra event of BYTES "x" (default 256 KiB) before the tokens

Lifecycle faults, for the whole worker:

    pause()            close the listening socket and cut open connections: a dead
                       worker (connects are refused)
    freeze()           cut open connections, then accept new ones at the TCP level and
                       never read or answer them: a hung process
    blackhole()        cut open connections, then let connects time out (SYNs dropped)
    resume()           listen on the same port again: a restarted worker

A worker run as its own process takes the same outages over HTTP: POST /fake/outage
{"mode": "pause"|"freeze"|"blackhole", "seconds": S} answers 202, then resumes after S s.
`python -m vllm_gateway.fake_worker --help` runs one from the shell.
"""

from vllm_gateway.fake_worker.config import FAULT_NAMES, FakeWorkerConfig, Fault, parse_fault
from vllm_gateway.fake_worker.server import FAULT_HEADER, FakeWorker, run_forever
from vllm_gateway.fake_worker.stats import FakeStats, RequestRecord

__all__ = [
    "FAULT_HEADER",
    "FAULT_NAMES",
    "FakeStats",
    "FakeWorker",
    "FakeWorkerConfig",
    "Fault",
    "RequestRecord",
    "parse_fault",
    "run_forever",
]
