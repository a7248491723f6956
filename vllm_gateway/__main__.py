"""`python -m vllm_gateway` runs the command-line interface."""

from vllm_gateway.cli.main import main

if __name__ == "__main__":
    main()
