"""The share of its threads' CPU time a step gets, alone and beside busy processes: what
the calibration's contention check (ember.engine.calibration, CONTENDED_SHARE) reads.

    python benchmarks/cpu_share.py

The default model in bf16, in process, its idle work done; six 512-token prefill steps and
ten decode steps, each measured as the process's CPU seconds over the step's wall time x
torch's threads; then the same beside one and two shell loops spinning on a core, and
alone again.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_steps import settled_llm  # noqa: E402


def main() -> None:
    llm, prompt = settled_llm()
    engine = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0)
    decode = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def timed_step() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall = time.perf_counter() - wall
        return (time.process_time() - cpu) / (wall * torch.get_num_threads()), wall * 1e3

    def measure(label: str) -> None:
        prefill = []
        for i in range(6):
            engine.add_request(f"{label}{i}", engine.process_prompt(prompt(512)), one)
            prefill.append(timed_step())
        engine.add_request(f"{label}-d", engine.process_prompt(prompt(20)), decode)
        engine.step()
        decodes = [timed_step()[0] for _ in range(10)]
        while engine.has_unfinished():
            engine.step()
        shares = ", ".join(f"{s:.2f}" for s, _ in prefill)
        times = ", ".join(f"{ms:.0f}" for _, ms in prefill)
        print(
            f"{label}: 512-token steps share {shares} (ms {times}); "
            f"decode steps' median share {statistics.median(decodes):.2f}"
        )

    measure("alone")
    hogs = []
    for label in ("beside one busy process", "beside two"):
        hogs.append(subprocess.Popen(["sh", "-c", "while :; do :; done"]))
        time.sleep(0.5)
        measure(label)
    for hog in hogs:
        hog.kill()
    time.sleep(0.5)
    measure("alone again")


if __name__ == "__main__":
    main()
