"""What an engine does with the moments it has nothing to serve, a slice at a time.

An engine core process asks `pending()` when no step is due and runs `step()` (a few
milliseconds; a calibration step, up to a 512-token prefill) until a request arrives or
nothing is left. In order:

1. the KV pool's pages, taken a few at a time ahead of use (ember.kv.buffers.Prefaulter:
   a pool the OS hands out on first touch costs nothing at start; its parts' first pages
   stay on 4 KB pages until then, so that a first request's writes cost little);
2. each bf16 matmul timed whole and split by rows, so that each step takes the faster
   (ember.engine.matmul_split.SplitTuner);
3. the step cost model's calibration on synthetic requests (ember.engine.calibration;
   dropped as soon as a real request arrives, and never while it waits for a busy CPU
   to settle);
4. oneDNN's primitives for every rounded row count a bf16 step with decodes can have
   (ember.engine.padded_rows.PrimitiveWarmer; a longer step of prompts alone makes its
   own, in a time like a step's).

Each is done for good once done; none changes what a request's tokens are.
"""

from __future__ import annotations

from ember.config import EngineConfig
from ember.engine.calibration import Calibrator
from ember.engine.kv_cache import KVCacheManager
from ember.engine.matmul_split import SplitTuner
from ember.engine.padded_rows import PrimitiveWarmer
from ember.engine.step_cost import StepCostModel
from ember.kv.buffers import Prefaulter
from ember.models import huge_pages


class IdleWork:
    def __init__(
        self,
        config: EngineConfig,
        runner,
        kv_cache: KVCacheManager,
        step_cost: StepCostModel,
        max_model_len: int,
        vocab_size: int,
        calibrate: bool,
    ) -> None:
        kv = runner.worker_kv  # every rank's pool, where the ranks can take their pages
        # a pool of its own (not in a shared-memory file) is on 2 MB pages where they apply
        huge = runner.kv_shm_path is None and huge_pages.applies()
        self.prefaulter = Prefaulter(
            kv.every_tensor() if kv else runner.kv_caches, small_heads=huge
        )
        self.calibrator = Calibrator(
            runner, kv_cache, step_cost, max_model_len, vocab_size, enabled=calibrate
        )
        model = runner.model if config.world_size == 1 else None  # one process: its matmuls
        self.split_tuner = SplitTuner(model, config.max_step_tokens)
        self.warmer = PrimitiveWarmer(model, config.max_num_batched_tokens)

    def pending(self) -> bool:
        """Whether an idle moment has a use now (the split tuner and the calibration wait
        while a busy CPU settles: then not, until it has)."""
        ready = not self.prefaulter.done or self.split_tuner.ready or self.calibrator.ready
        return ready or not self.warmer.done

    def step(self) -> None:
        """One slice of the first of them not done; call only when no step is due."""
        if not self.prefaulter.done:
            self.prefaulter.step()
        elif self.split_tuner.ready:
            self.split_tuner.step()
        elif self.calibrator.ready:
            self.calibrator.step()
        elif not self.warmer.done:
            self.warmer.step()

    def served(self) -> None:
        """A request arrived: served steps teach the cost model from here on."""
        self.calibrator.drop()
