"""The OpenAI-compatible API server (`ember serve`)."""
