"""How much an ember server accepts and keeps, by default (the flags of `ember serve` set
them; the guard and the Responses store use them).
"""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body larger than this is a 413
DEFAULT_STORE_CHARS = 64 << 20  # characters of conversation /v1/responses keeps
DEFAULT_ENGINE_RESTARTS = 3  # an engine core that dies is started again this many times
MAX_MESSAGES = 10_000  # messages (or input items) of one request; more is a 400
MAX_TOOLS = 512  # tools offered in one request (OpenAI allows 128)
MAX_TEMPLATE_KWARGS = 64  # chat_template_kwargs' variables
DEFAULT_READ_TIMEOUT_S = 30.0  # a request's head, and then its body, must come within this
DEFAULT_MAX_CONNECTIONS = 2048  # connections (and requests) at once; more get a 503
DEFAULT_MAX_QUEUED_REQUESTS = 1024  # waiting sequences a worker holds; more are a 429
