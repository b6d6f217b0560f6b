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

SERVER_IMPORTS = """
import sys
sys.modules["torch"] = None  # blocked: any import of it raises
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
    options = spec.check(spec.parse_options({}), 2).server_options(TrainConfig())
    rule = schemes.make_server_rule(name, options, 2)
    shard = Shard(index=0, scheme=name, options_json="{}", num_workers=2,
                  values={"w#0": np.zeros(4, np.float32)}, rule=rule)
    shard.push({"w#0": np.ones(4, np.float32)}, PushMeta(worker=0, incarnation=1, base_version=0))
    shard.to_bytes()
loaded = sys.modules["torch"] is not None
print(json.dumps({"torch": loaded, "torch._C": "torch._C" in sys.modules}))
"""


def test_server_side_code_runs_without_importing_torch() -> None:
    """Every scheme's server rule is built, pushed to and saved with torch blocked (and no
    stand-in module): the scheme catalogue and the server import no PyTorch at all."""
    code = "import json\n" + SERVER_IMPORTS
    done = loadclock.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch": False, "torch._C": False}


def test_the_launcher_imports_no_torch() -> None:
    """The launcher, the CLI and the server import no PyTorch, with no stand-in module
    (issue 39's check): ``distsgd run`` never loads it outside the workers."""
    code = (
        "import json, sys\n"
        "import distsgd.cli.entry, distsgd.cli.main, distsgd.launcher.run, distsgd_compare.run\n"
        "import distsgd.cli.inspect, distsgd.ps.server, distsgd.schemes\n"
        "from distsgd.schemes import make_server_rule\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    done = loadclock.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "false"


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
