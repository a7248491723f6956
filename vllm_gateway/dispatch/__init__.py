"""Choosing a worker for a request: dispatcher and lease, token buckets, admission queue, load
view, policies.
"""
