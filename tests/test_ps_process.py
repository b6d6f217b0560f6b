"""A parameter-server process imports no PyTorch, and a killed server serves again quickly."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import loadclock
import pytest
from conftest import ROOT, metrics, task_pids, wait_for

from distsgd.util.lazy import defer_import

SERVER_IMPORTS = """
import sys
from distsgd.util.lazy import defer_import, is_loaded
defer_import("torch")
import numpy as np
import distsgd.cli.main
from distsgd import schemes
from distsgd.ps.rules import PushMeta
from distsgd.ps.shard import Shard
from distsgd.control.config import TrainConfig
for name in schemes.names():
    spec = schemes.get(name)
    if spec.server is None:
        continue
    options = spec.worker(spec.parse_options({}), 2).server_options(TrainConfig())
    rule = schemes.make_server_rule(name, options, 2)
    shard = Shard(index=0, scheme=name, options_json="{}", num_workers=2,
                  values={"w#0": np.zeros(4, np.float32)}, rule=rule)
    shard.push({"w#0": np.ones(4, np.float32)}, PushMeta(worker=0, incarnation=1, base_version=0))
    shard.to_bytes()
print(json.dumps({"torch": is_loaded("torch"), "torch._C": "torch._C" in sys.modules}))
"""


def test_server_side_code_runs_without_importing_torch() -> None:
    """Every scheme's server rule is built, pushed to and saved with torch deferred: were any
    module the server imports to touch torch while importing (``from torch import nn``, a
    ``@torch.no_grad()`` decorator), torch would be loaded here."""
    code = "import json\n" + SERVER_IMPORTS
    done = loadclock.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch": False, "torch._C": False}


def test_the_launcher_imports_no_torch() -> None:
    """``distsgd run`` of a parameter-server scheme never needs PyTorch in the launcher."""
    code = (
        "import json, sys\n"
        "from distsgd.util.lazy import defer_import, is_loaded\n"
        "defer_import('torch')\n"
        "import distsgd.cli.main, distsgd.launcher.run, distsgd.compare.run\n"
        "import distsgd.cli.inspect\n"
        "print(json.dumps(is_loaded('torch')))\n"
    )
    done = loadclock.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "false"


def test_deferred_module_loads_on_first_use() -> None:
    code = (
        "from distsgd.util.lazy import defer_import, is_loaded\n"
        "assert defer_import('wave')\n"
        "import wave\n"
        "assert not is_loaded('wave')\n"
        "assert wave.Error is not None and is_loaded('wave')\n"
        "print('ok')\n"
    )
    done = loadclock.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
    assert defer_import("os") is False  # imported already: nothing changes


@pytest.mark.slow
@pytest.mark.xdist_group("demo-runs")
def test_a_killed_server_serves_again_within_two_seconds(spawn, tmp_path: Path) -> None:
    """SIGKILL of ps0 mid-run: the launcher sees it within a poll, restarts it at once (first
    restart, no backoff), and the new process listens again quickly (no PyTorch to import).
    10 epochs (about 50 metrics lines; 60, then 20 before): the kill comes after the first 10,
    and the run only has to outlast the restart, not train on long after it."""
    run_dir = tmp_path / "run"
    proc = spawn(
        ["demo", "--scheme", "hogwild", "--epochs", "10", "--quiet", "--run-dir", str(run_dir)]
    )
    assert wait_for(lambda: len(metrics(run_dir)) >= 10, 90), "no progress"
    address_file = run_dir / "ps0.address"
    before = address_file.stat().st_mtime_ns
    watch = loadclock.Stopwatch()
    killed = time.time()
    os.kill(task_pids(run_dir)["ps0"], signal.SIGKILL)
    assert wait_for(lambda: address_file.exists() and address_file.stat().st_mtime_ns != before, 30)
    serving = address_file.stat().st_mtime
    fair = (serving - killed) * watch.share()  # a busy machine's wall seconds count less
    out, _ = loadclock.communicate(proc, 240)
    assert proc.returncode == 0, out[-3000:]
    print(f"ps0 listening again {serving - killed:.2f} s ({fair:.2f} fair s) after SIGKILL")
    assert fair < 2.0, (serving - killed, fair)
