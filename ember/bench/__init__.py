"""Benchmarks: offline engine speed (`ember bench offline`)."""
