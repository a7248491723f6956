"""The `vllm-gateway` command line: serve, demo, chat, fake-worker, the fleet verbs, the agent,
rollout.
"""
