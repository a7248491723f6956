"""A vLLM stand-in: OpenAI wire format, /metrics, continuous batching and faults.

    worker = FakeWorker(FakeWorkerConfig(models=("m",), max_num_seqs=4))
    await worker.start()            # 127.0.0.1, free port -> worker.url
    ...                             # worker.stats counts what happened
    await worker.stop()

Faults, worker-wide (config.fault, set_fault, POST /fake/fault) or per request
(header X-Fake-Fault: NAME or NAME=PARAM, "none" to opt out): see config.FAULT_NAMES.
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
