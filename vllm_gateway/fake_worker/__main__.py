"""`python -m vllm_gateway.fake_worker`: the same as `vllm-gateway fake-worker`."""

from __future__ import annotations

import sys

from vllm_gateway.cli.main import main

if __name__ == "__main__":
    main(["fake-worker", *sys.argv[1:]], prog_name="python -m vllm_gateway.fake_worker")
