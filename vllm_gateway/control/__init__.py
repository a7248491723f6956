"""The control APIs: admin, FastChat-style registration, who may use them, their small JSON
bodies.
"""
