"""The issue's offline workload: `python benchmarks/offline.py [MODEL] [--compare-hf]`.

Same as `ember bench offline`: 64 prompts of ~256 tokens, 128 new tokens each,
ignore_eos; plus batch-1 latency and 4 concurrent requests of 286 + 64 tokens.
"""

from __future__ import annotations

import sys

from ember.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "offline", *sys.argv[1:]]))
