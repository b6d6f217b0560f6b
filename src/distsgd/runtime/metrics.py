"""``metrics.jsonl``: one JSON object per line, appended by every task of a run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends lines with ``time`` and ``task``; each line is one ``write`` on an O_APPEND file,
    so lines from concurrent tasks never interleave. A writer with no path drops everything."""

    def __init__(self, path: Path | None, task: str) -> None:
        self.task = task
        self._fd = (
            None if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        )

    def log(self, **fields: Any) -> None:
        if self._fd is None:
            return
        record = {"time": round(time.time(), 3), "task": self.task, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
