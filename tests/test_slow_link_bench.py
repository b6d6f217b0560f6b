"""The pure parts of ``benchmarks/slow_link.py``: each entry's command line (hosts for its
servers) and the table's pairing. No run is started (CI does not run the benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from conftest import ROOT


def _load() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "slow_link_bench", ROOT / "benchmarks" / "slow_link.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sl = _load()


def _hosts(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--hosts") + 1])


def test_a_server_scheme_gets_a_host_per_server() -> None:
    common = {"link": "10mbit", "workers": 4, "epochs": 2, "seed": 1, "run_dir": Path("/r")}
    diloco = sl.command("diloco --overlap-steps 5", **common)
    assert _hosts(diloco) == 4 and "--overlap-steps" in diloco and diloco[-1] == "/r"
    assert _hosts(sl.command("asyncdiloco --overlap", **common)) == 5
    assert _hosts(sl.command("downpour --ps 2", **common)) == 6
    assert diloco[diloco.index("--link") + 1] == "10mbit"
    assert diloco[diloco.index("--seed") + 1] == "1"


def test_the_time_ratio_is_paired_within_each_round() -> None:
    runs = {
        "a": [{"seconds": 2.0, "accuracy": 0.9, "bytes_sent": 1e6}] * 2,
        "b": [
            {"seconds": 1.0, "accuracy": 0.8, "bytes_sent": 5e5},
            {"seconds": 2.0, "accuracy": 1.0, "bytes_sent": 5e5},
        ],
    }
    rows = sl.table(["a", "b"], runs).splitlines()
    assert rows[2].startswith("| `a` | 0.9 ± 0 | 2 ± 0 | 1.00x | 1 |")
    assert rows[3] == "| `b` | 0.9 ± 0.2 | 1.5 ± 1 | 0.75x | 0.5 |"
