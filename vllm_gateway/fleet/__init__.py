"""Keeping the fleet's state current: probes, scrapes, the breaker, demand and autoscale,
discovery sources.
"""
