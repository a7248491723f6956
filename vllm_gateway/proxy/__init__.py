"""Relaying one request to one worker: the relay handler, the exchange seam, upstream pools."""
