"""A run's ``config.json``: what ``distsgd run --resume`` reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distsgd.util import write_atomic

CONFIG_FILE = "config.json"


def write_run_config(run_dir: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as the run folder's ``config.json``."""
    write_atomic(run_dir / CONFIG_FILE, json.dumps(data, indent=2) + "\n")


def load_run_config(run_dir: Path) -> dict[str, Any]:
    """The saved ``config.json`` of a run folder (for ``--resume``)."""
    path = run_dir / CONFIG_FILE
    try:
        saved = dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(
            f"{run_dir} is not a distsgd run folder (no {CONFIG_FILE}); "
            "give the folder of an earlier run"
        ) from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: damaged ({exc})") from None
    needed = (
        "script",
        "script_args",
        "scheme",
        "scheme_options",
        "overrides",
        "workers",
        "ps",
        "run_id",
    )
    missing = [key for key in needed if key not in saved]
    if missing:
        raise ValueError(f"{path}: damaged (no {', '.join(missing)}); it cannot be resumed")
    return saved
