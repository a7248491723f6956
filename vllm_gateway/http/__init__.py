"""The client side of the gateway: the server, the front path, aiohttp's side, client keys,
error answers.
"""
