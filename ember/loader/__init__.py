"""Checkpoint loading: GGUF files and the default model fetch."""
