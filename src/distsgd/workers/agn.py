"""The worker half of :mod:`distsgd.schemes.agn` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import numpy as np

from distsgd.schemes.agn import AgnRules
from distsgd.workers.downpour import DownpourWorker


class AgnWorker(AgnRules, DownpourWorker):
    def accumulated_update(
        self, start: np.ndarray, now: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        update = np.subtract(start, now, out=out)
        update /= self.pending
        return update
