"""The files of a run folder that the runtime writes and the launcher and the tools read."""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"
"""One JSON object per line from every task (``runtime.metrics.MetricsWriter``)."""
RESULT_FILE = "result.json"
"""The chief's :class:`~distsgd.runtime.loop.TrainResult` and the training config."""
FINAL_PARAMS_FILE = "final_model.pt"
"""The final parameters, a ``state_dict`` of tensors (``torch.load(weights_only=True)``)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files, a folder (one TensorBoard run) per task (``runtime.board``)."""
