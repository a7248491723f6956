"""What the gateway tells about itself: Prometheus metrics, the access log, the status page and
/stats.
"""
