"""How much an ember server accepts and keeps, by default (the flags of `ember serve` set
them; the guard and the Responses store use them).
"""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body larger than this is a 413
DEFAULT_STORE_CHARS = 64 << 20  # characters of conversation /v1/responses keeps
DEFAULT_ENGINE_RESTARTS = 3  # an engine core that dies is started again this many times
