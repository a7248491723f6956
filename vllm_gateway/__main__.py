"""`python -m vllm_gateway` runs the command-line interface."""

from vllm_gateway.cli import main

if __name__ == "__main__":
    main()
