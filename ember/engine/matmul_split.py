"""Whether a bf16 matmul runs whole or split by rows, measured on this CPU.

On two threads oneDNN threads some bf16 matmul shapes well at some row counts and runs
others at what amounts to one thread's speed (an AMX Xeon: SmolLM2's qkv at 768-1,024
rows, its o_proj at 384-768, its down_proj up to 1,280; docs/benchmarks.md); ember's
`linear_split_rows` then runs the rows in two ranges, a thread each, and wins by up to
2x, where elsewhere it loses by up to 1.3x. The boundaries move with the shape and the
CPU, and fall between row counts a few dozen apart (qkv: 1,024 rows one way, 1,088 the
other), so `SplitTuner` times both while the engine is idle, for each distinct packed
bf16 matmul of the model: every SAMPLE_ROWS rows a step can have, then, between two
samples that disagree, the row count where the winner changes, to ROW_QUANTUM rows
(bisection). Every `Linear` of the shape gets the table (`Linear.split_by_rows`). The
layers' own weights are timed, several in turn, as a step reads them (from memory, not
cache). A choice moves from the rule it starts from (`Linear.split_default`) only for a
gain of more than MARGIN, so that noise does not flip it from one start to the next;
$EMBER_MATMUL_SPLIT=rule keeps the rule.

The two ways differ in the last bits of some rows (oneDNN's whole call accumulates in
another order at some row counts), as a bf16 step's rows already do with the step's row
count; exact fp32 steps never split.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from ember import envs
from ember.engine.calibration import ContentionBackoff
from ember.engine.padded_rows import ROW_QUANTUM, rounded
from ember.models.layers import SPLIT_MAX_THREADS, SPLIT_MIN_PART_ROWS, Linear, split_ranges

MARGIN = 0.1  # a choice moves from the rule's only where the other is this much faster
COPIES = 6  # distinct weights of a shape timed in turn (a step reads each layer's once)
ROUNDS = 2  # alternating whole and split; the best round of each counts
SAMPLE_ROWS = 128  # the row counts timed first, this many apart

# (the shape's linears, rows, parts) -> (seconds whole, seconds split) per weight, and
# the share of their CPU time the threads had (ContentionBackoff)
Measure = Callable[[list[Linear], int, int], tuple[float, float, float]]


def time_both(linears: list[Linear], rows: int, parts: int) -> tuple[float, float, float]:
    """Seconds per call of a shape's matmul at `rows` rows, whole and split in `parts`:
    the best of ROUNDS rounds over up to COPIES of its weights, after a call of each that
    makes oneDNN's primitives; and the threads' share of CPU time over the rounds."""
    weights = [linear.packed for linear in linears[:COPIES]]
    first = linears[0]
    x = torch.randn(rows, first.weight.shape[1]).bfloat16()
    bias = first.bias.bfloat16() if first.bias is not None else None
    pointwise = torch.ops.mkldnn._linear_pointwise

    def whole() -> None:
        for w in weights:
            pointwise(x, w, bias, "none", [], "")

    def split() -> None:
        for w in weights:
            first.split_rows(x, w, bias, parts)

    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        whole(), split()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(ROUNDS):
            for i, run in enumerate((whole, split)):
                start = time.perf_counter()
                run()
                best[i] = min(best[i], (time.perf_counter() - start) / len(weights))
        wall = time.perf_counter() - wall
    share = (time.process_time() - cpu) / (wall * torch.get_num_threads())
    return best[0], best[1], share


class SplitTuner:
    """Idle work: one row count of one shape timed a `step()` (`ready`: not while waiting
    out another process's use of the CPU, as the calibration does); `done` once each
    shape's linears have their table. Nothing to do off two threads (`SPLIT_MAX_THREADS`: with
    more, oneDNN threads every shape and the split never runs), without bf16 matmuls
    that can split, or with $EMBER_MATMUL_SPLIT=rule."""

    def __init__(self, model, max_rows: int, measure: Measure = time_both) -> None:
        shapes: dict[tuple, list[Linear]] = {}
        for name, module in model.named_modules() if model is not None else ():
            # the head multiplies the rows sampled, a few (and it is the slowest to time)
            head = name.rsplit(".", 1)[-1] == "lm_head"
            if isinstance(module, Linear) and module.split_rows is not None and not head:
                key = (tuple(module.weight.shape), module.bias is None)
                shapes.setdefault(key, []).append(module)
        if not 1 < torch.get_num_threads() <= SPLIT_MAX_THREADS or envs.matmul_split() == "rule":
            shapes = {}
        self.shapes = shapes
        self.max_rows = rounded(max_rows)
        self.measure = measure
        self.timings: dict[tuple, list[tuple[int, float, float]]] = {key: [] for key in shapes}
        self._plan = self._tune_all()
        self._done = not shapes or self.max_rows < 2 * SPLIT_MIN_PART_ROWS
        self.backoff = ContentionBackoff("matmul timing")

    @property
    def done(self) -> bool:
        return self._done

    @property
    def ready(self) -> bool:
        """A timing is left and may run now (not waiting out a busy CPU)."""
        return not self._done and self.backoff.ready

    def step(self) -> None:
        if not self._done:
            self._done = next(self._plan, True) is True

    def _tune_all(self) -> Iterator[None]:
        for key, linears in self.shapes.items():
            yield from self._tune(key, linears)
        yield True

    def _tune(self, key: tuple, linears: list[Linear]) -> Iterator[None]:
        """Times the shape's samples, then each boundary between two that disagree, a
        row count a step (yield), and gives its linears the table."""
        default = linears[0].split_default
        wins: dict[int, bool] = {}  # rows -> whether the split wins there

        def timed(rows: int) -> Iterator[None]:
            while True:  # again, while another process had the CPU
                whole_s, split_s, share = self.measure(linears, rows, split_ranges(rows))
                if not self.backoff.contended((whole_s + split_s) * COPIES * 1e3, share):
                    break
                yield
            self.timings[key].append((rows, whole_s, split_s))
            if default:  # the rule splits here: whole only if clearly faster
                wins[rows] = not whole_s < split_s * (1 - MARGIN)
            else:
                wins[rows] = split_s < whole_s * (1 - MARGIN)

        first = rounded(2 * SPLIT_MIN_PART_ROWS)  # the fewest rows that split in two
        samples = sorted(
            {first, *range(SAMPLE_ROWS * 2, self.max_rows, SAMPLE_ROWS), self.max_rows}
        )
        samples = [rows for rows in samples if first <= rows <= self.max_rows]
        for rows in samples:
            yield from timed(rows)
            yield
        for low, high in zip(samples, samples[1:], strict=False):
            while wins[low] != wins[high] and high - low > ROW_QUANTUM:
                middle = low + (high - low) // (2 * ROW_QUANTUM) * ROW_QUANTUM
                yield from timed(middle)
                if wins[middle] == wins[low]:
                    low = middle
                else:
                    high = middle
                yield
        table, known = [], sorted(wins)
        for index in range(self.max_rows // ROW_QUANTUM + 1):
            rows = index * ROW_QUANTUM
            below = [r for r in known if r <= rows]  # the nearest row count timed below
            table.append(rows >= first and wins[below[-1]] if below else False)
        shared = tuple(table)
        for linear in linears:
            linear.split_by_rows = shared
