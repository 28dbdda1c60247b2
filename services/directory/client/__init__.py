"""The Directory's client side: `api` (the Python client) and `cli` (the command line over it).
Nothing here is imported by the server."""
