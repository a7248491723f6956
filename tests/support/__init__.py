"""Helpers shared by tests: raw HTTP, a byte-scripted worker, gateway processes."""
