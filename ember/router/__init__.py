"""The token-aware router (`ember router`): one OpenAI endpoint in front of workers."""
