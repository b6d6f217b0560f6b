"""Shared helpers: run the real ``distsgd`` command in a child process and clean up after it."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import ipaddress
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fork_template
import loadclock
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

# Scripts run alone (python script.py, doc blocks, distsgd.train in-process) write a run folder
# under $DISTSGD_RUNS: here a temporary one per test process, not the checkout's distsgd-runs/.
_RUNS = tempfile.mkdtemp(prefix="distsgd-test-runs-")
os.environ["DISTSGD_RUNS"] = _RUNS
atexit.register(shutil.rmtree, _RUNS, True)

# A shell without job control starts a background command (`bash .ci/run &`, `nohup ... &`)
# with SIGINT ignored, and every process inherits that: Python then installs no Ctrl-C handler,
# and the tests that send SIGINT (to a script run alone, to this process) would see it ignored
# rather than act as from a terminal. Each test process starts from Python's own handler.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One torch thread in each test process and in each script a test runs alone (a run's own
# tasks get the launcher's budget): the suite's three test processes share the CI machine's two
# cores, and pools of two threads each spun against each other (test_lm_demo's short run: 75
# CPU-s under load, 41 on one thread).
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
if "torch" in sys.modules:  # not imported by now, as a rule; where it is, the same budget
    sys.modules["torch"].set_num_threads(1)


SLOW_FIRST = (
    "test_benchmarks.py::test_quick_suite_writes_every_row_and_cleans_up",
    "test_ray.py::test_a_run_on_ray_survives_a_killed_worker_grows_shrinks_and_leaves_nothing",
    "test_defaults.py::test_a_cnn_tuned_alone_trains_within_3_points_on_4_workers",
    "test_ddp_hooks.py::test_hooks_train_and_count_what_they_all_reduce",
    "test_compressed_push.py::test_the_demo_with_compressed_pushes_keeps_its_accuracy",
    "test_localsgd.py::test_period_one_equals_allreduce_sgd",
    "test_elastic.py::test_collective_run_survives_2_4_1_3_by_restarts_from_its_checkpoints",
    "test_elastic.py::test_run_grows_and_shrinks_2_4_1_3_without_losing_a_sample",
    "test_fault_tolerance.py::test_a_plain_loop_keeps_its_accuracy_on_4_workers",
    "test_elastic.py::test_join_adds_a_worker_in_its_own_process",
    "test_compare.py::test_compare_writes_figure_table_and_json_and_survives_a_failed_scheme",
    "test_keras.py::test_keras_cnn_trains_under_distsgd_run",
    "test_fault_tolerance.py::test_resume_names_a_damaged_checkpoint",
    "test_streaming.py::test_data_twice_the_memory_limit_trains_to_the_in_memory_accuracy",
    "test_alone_interrupt.py::test_ctrl_c_of_a_script_alone_is_one_line",
    "test_safe_defaults.py::test_a_run_that_did_not_learn",
    "test_runtime_units.py::test_a_script_run_alone_writes_a_run_folder",
    "test_no_code_in_files.py::test_a_real_run_folder_with_a_crafted_checkpoint",
    "test_ray.py::",
    "test_compare.py::test_a_real_tuned_repeated_comparison",
    "test_safe_defaults.py::test_ps_killed_after_the_chief_finished",
    "test_ddp_hooks.py::test_a_model_whose_used_parameters_change_is_told_to_run_with_dynamic",
    "test_readme_example.py::",
    "test_cli.py::test_manual_cluster_with_server_and_worker_commands",
    "test_own_loop.py::test_forward_past_the_ddp_wrapper_is_named",
    "test_fault_tolerance.py::test_kill_during_checkpoint_writes_then_resume",
    "test_safe_defaults.py::",
    "test_work_units.py::test_a_killed_worker_and_a_worker_sent_sigterm",
    "test_collective_sockets.py::test_collective_run_listens_on_loopback_only",
    "test_k8s.py::test_k8s_local_",
    "test_launcher.py::",
    "test_elastic.py::",
    "test_diloco.py::test_diloco_equals_the_reference",
    "test_own_loop.py::",
    "test_own_loop_features.py::test_accumulation_under_allreduce",
    "test_checkpoint_background.py::",
    "test_keras.py::test_names_do_not_depend_on_what_the_process_built_before",
    "test_ps_process.py::test_a_killed_server_serves_again_within_two_seconds",
    "test_run_security.py::test_delay_and_partition_faults",
    "test_compare.py::test_sigint_stops_the_current_run_and_skips_the_rest",
    "test_tutorial.py::",
    "test_docs.py::test_python_block_runs[",
    "test_fault_tolerance.py::",
)
"""Tests of about 15 s or more (pytest --durations of a whole run), longest first (those of an
xdist_group run in this order within their group): started before the short ones, so that no
long test starts last while the other test processes have run out of work."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests in SLOW_FIRST first, in its order; the rest as collected. (``--dist
    loadgroup`` hands each xdist_group's tests to one test process as a whole, the largest
    groups first, then the other tests in this order.)"""

    def rank(item: pytest.Item) -> int:
        path, _, name = item.nodeid.partition("::")
        key = f"{Path(path).name}::{name}"
        return next(
            (i for i, slow in enumerate(SLOW_FIRST) if key.startswith(slow)),
            len(SLOW_FIRST),
        )

    items.sort(key=rank)


LOCKED_GROUPS = ("ray", "hosts")
"""xdist groups whose tests run one at a time across the test processes: "ray" (each asserts
that no Ray process is left on the machine, so another's local Ray instance fails it) and
"hosts" (a run on emulated hosts gives the launcher 198.18.0.253: one such run at a time)."""


@pytest.fixture(autouse=True, scope="session")
def _fork_server_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Runs' fork servers forked from one template per test process (:mod:`fork_template`)."""
    if not fork_template.wanted():
        yield
        return
    with fork_template.running(tmp_path_factory.mktemp("fork-template")):
        yield


@pytest.fixture(autouse=True)
def _own_fork_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests marked ``own_fork_server`` run as a user's run would, each launcher starting its
    own fork server (those that judge the launcher's own process tree)."""
    if request.node.get_closest_marker("own_fork_server"):
        monkeypatch.delenv(fork_template.TEMPLATE_ENV, raising=False)


@pytest.fixture(autouse=True)
def _one_locked_group_test_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The tests marked ``xdist_group(G)``, G in :data:`LOCKED_GROUPS`, one at a time per
    group, by a lock file, wherever the mark alone does not do it: ``--dist loadgroup`` runs a
    group on one test process, but another ``--dist``, or pytest 9.2 with pytest-xdist 3.8
    (issue 1386: the marks are ignored), spreads its tests over several."""
    groups = {m.args[0] for m in request.node.iter_markers("xdist_group") if m.args}
    locked = sorted(groups.intersection(LOCKED_GROUPS))
    with contextlib.ExitStack() as stack:
        for group in locked:  # in name order: two groups never wait on each other in a cycle
            lock = tmp_path_factory.getbasetemp().parent / f"distsgd-{group}-tests.lock"
            held = stack.enter_context(open(lock, "a"))
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        yield


def netns_refusal(*, root: bool = False) -> str | None:
    """Why emulated hosts cannot be made here (None: they can); ``root``: the test also needs
    the launcher's link to them, which only root may add."""
    from distsgd_emulate.netns import check_capable

    try:
        check_capable()
    except ValueError as e:
        return str(e)
    if root and os.geteuid() != 0:
        return "the launcher's link to emulated hosts needs root"
    return None


def on_emulated_hosts(cannot: str | None) -> Callable[[Any], Any]:
    """The marks of a test that makes network namespaces: skipped where it ``cannot`` (why;
    None: it can), and one such test at a time (the "hosts" group of LOCKED_GROUPS). The pure
    tests of the same modules take no lock: marked for the whole module, they waited for the
    other test process's run on emulated hosts with their process idle (14 s once)."""

    def mark(test: Any) -> Any:
        skip = pytest.mark.skipif(cannot is not None, reason=str(cannot))
        return pytest.mark.xdist_group("hosts")(skip(test))

    return mark


def distsgd_cmd(*args: str) -> list[str]:
    """``distsgd ARGS`` as this Python runs it; ``distsgd-emulate ARGS`` where the first word
    is ``distsgd-emulate`` (the emulators' command)."""
    if args[:1] == ("distsgd-emulate",):
        return [sys.executable, "-m", "distsgd_emulate", *args[1:]]
    return [sys.executable, "-m", "distsgd", *args]


def run_distsgd(
    args: Sequence[str], *, timeout: float = 240.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``distsgd ARGS`` to the end; output captured as text. ``timeout`` counts fair
    seconds (:mod:`loadclock`): it stretches with the machine's load."""
    cmd = distsgd_cmd(*args)
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    ) as proc:
        out, err = loadclock.communicate(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_scheme(
    scheme: str, run_dir: Path, script: str | Path, *script_args: str, workers: int = 2
) -> subprocess.CompletedProcess[str]:
    """``distsgd run`` of ``script`` under ``scheme``, quiet, into ``run_dir``."""
    args = ["run", "--workers", str(workers), "--scheme", scheme, "--quiet"]
    return run_distsgd([*args, "--run-dir", str(run_dir), str(script), *script_args])


def final_accuracy(done: subprocess.CompletedProcess[str]) -> float:
    """The ``test accuracy: X`` the launcher prints as its last line (asserts it is there)."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("test accuracy: "), last
    return float(last.split(":")[1])


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_pids(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "tasks.json").read_text())


def alive(pids: Sequence[int]) -> list[int]:
    """PIDs among ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``predicate()`` came true within ``timeout`` fair seconds (:mod:`loadclock`:
    the wait stretches with the machine's load)."""
    deadline = loadclock.Deadline(timeout)
    while not deadline.expired():
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Where ``$DISTSGD_TEST_CPU`` names a file: one line per test appended to it, its CPU
    seconds (the test process and every child it waited for, their children included) and
    its name, to find what the suite spends its 2 cores on (``sort -rn FILE | head``)."""
    path = os.environ.get("DISTSGD_TEST_CPU")
    if not path:
        yield
        return
    before = _cpu_seconds()
    yield
    with open(path, "a") as f:
        f.write(f"{_cpu_seconds() - before:.2f} {item.nodeid}\n")


def _cpu_seconds() -> float:
    own, waited = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's per-test limit in fair seconds (:mod:`loadclock`): when the limit's
    wall time has passed but the machine was too busy to give the test that much time, the
    timer is set again for what is left (up to ``MAX_STRETCH`` times the limit in all)."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer
    import pytest_timeout

    deadline = loadclock.Deadline(settings.timeout)

    def handler(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        if not deadline.expired():
            signal.setitimer(signal.ITIMER_REAL, max(1.0, deadline.left()))
            return
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


@pytest.fixture
def spawn() -> Iterator:  # type: ignore[type-arg]
    """Start ``distsgd`` commands in the background; every one (and its tree) ends with the test."""
    started: list[psutil.Popen] = []

    def start(args: Sequence[str], **kw) -> psutil.Popen:  # type: ignore[no-untyped-def]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
        proc = psutil.Popen(
            distsgd_cmd(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            env=env,
            **kw,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            try:
                tree = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in reversed(tree):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait(timeout=10)


@pytest.fixture
def ps_server() -> Iterator[tuple[str, object]]:
    """One in-process parameter server (shard 0, the default rules) on a free loopback port;
    yields (address, service) and stops the server with the test."""
    from distsgd.ps import start_server, stop_server
    from distsgd.schemes import make_server_rule

    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        yield address, service
    finally:
        stop_server(srv, service, grace=0.1)


def one_cert_for_all(folder: Path, ips: Sequence[str] = ("127.0.0.1",)) -> dict[str, Path]:
    """A CA and one certificate (SAN ``ips`` and localhost, server and client use) that every
    task shares."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("distsgd test CA"))
        .issuer_name(name("distsgd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("distsgd task"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
                    x509.DNSName("localhost"),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {"ca": folder / "ca.crt", "cert": folder / "task.crt", "key": folder / "task.key"}
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    files["key"].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files
