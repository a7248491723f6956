"""vllm-gateway: one front door for many vLLM servers."""

__version__ = "0.1.0"
