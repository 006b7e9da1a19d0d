"""`ember plan`: how many prefill and decode workers a workload needs to meet its SLOs.

- `demand.py`: a trace (Mooncake JSONL, or an `ember bench serve --out` JSON) as the
  requests a cluster must serve: arrival, prompt tokens, tokens a prefix cache would not
  hold, output tokens;
- `profile.py`: what one worker does, measured over HTTP (`ember plan profile`): TTFT of
  lone prompts by length, the decode step by batch and context, fitted to a cost model;
- `model.py`: the arithmetic (queueing and Little's law) that turns a profile and a
  demand into predicted TTFT, ITL and utilisation for P prefill + D decode workers, or M
  mixed ones, and the search for the smallest cluster meeting the SLOs;
- `command.py`: the command line.
"""

# the probes `ember plan profile` sends by default (here: the command line reads them
# without importing numpy)
PREFILL_LENGTHS = (16, 64, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 1024)
