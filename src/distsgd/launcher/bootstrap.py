"""Run a user's training script as one worker task.

Usage: ``python -m distsgd.launcher.bootstrap SCRIPT [ARGS...]``.

The launcher puts the task's :class:`~distsgd.control.task.TaskEnv` in ``DISTSGD_TASK``; this module
ties the process to the launcher, applies the thread budget, sets up logging, and runs the
script as ``__main__``. A script that never calls ``distsgd.train`` (or makes a
``distsgd.Worker``) is an error (the rest of the cluster would wait for it forever), and so is
one that fails before it calls either: its own code failed (a syntax error, an import, its
arguments, its data), the same again on a restart, so the task exits with the setup-error code
that the launcher does not restart. A script that fails after its training finished (after
``train`` returned, or its ``Worker`` finished) is not restarted either: the error is the
script's own, training's result stands, and a restart would train again and overwrite it
(exit code ``AFTER_TRAINING_EXIT_CODE``).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from distsgd.control.divergence import DIVERGED_EXIT_CODE, Diverged
from distsgd.control.errors import (
    AFTER_TRAINING_EXIT_CODE,
    SETUP_ERROR_PREFIX,
    SETUP_EXIT_CODE,
    ErrorKind,
    SetupError,
    SetupErrorRecord,
    one_line,
)
from distsgd.control.remote_files import from_environ
from distsgd.launcher.lifeline import limit_threads, tie_to_parent

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format=LOG_FORMAT, datefmt="%H:%M:%S", stream=sys.stderr, force=True
    )


def run_script(script: str, args: Sequence[str]) -> int:
    """Run ``script`` with ``args`` as this task; returns the process exit code."""
    from distsgd import api  # here: ``distsgd server`` uses this module's logging without torch

    path = Path(script)
    if not path.is_file():
        print(
            f"distsgd: error: script {script} not found; give the path of a Python file",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except Diverged as exc:
        print(f"distsgd: diverged: {exc}", file=sys.stderr)
        return DIVERGED_EXIT_CODE
    except SetupError as exc:  # the same script and flags would fail again: no traceback
        logging.getLogger(__name__).debug("setup refused", exc_info=True)
        return refuse_setup(exc)
    except SystemExit as exc:
        failed = exc.code not in (None, 0)
        if failed and api.trained:
            return after_training(script, exited(exc))
        if api.calls:
            raise
        if failed:
            return refuse_setup(SetupError(before_training(script, exited(exc))))
        # exit 0 before distsgd was called: as a script that returned without calling it
    except Exception as exc:
        if api.calls and not api.trained:  # while training: restarted; named if it repeats
            record_setup_error(SetupError(raised(exc, path)), kind="crash")
            raise
        traceback.print_exc()  # once: where in the script, for the person who fixes it
        if api.trained:
            return after_training(script, raised(exc, path))
        return refuse_setup(SetupError(before_training(script, raised(exc, path))))
    if api.unfinished:
        return refuse_setup(
            SetupError(
                f"{script} made a distsgd.Worker but never called worker.finish(), so its "
                "result was not saved; call it after the loop (or use `with distsgd.Worker(...) "
                "as worker:`)"
            )
        )
    if api.calls == 0:
        return refuse_setup(
            SetupError(
                f"{script} finished without calling distsgd.train() or making a "
                "distsgd.Worker; call one from the script's main code"
            )
        )
    return 0


def before_training(script: str, what: str) -> str:
    """A setup error's message for a script that failed before it called distsgd: its own
    code failed (a syntax error, an import, its arguments, its data), so a restart would fail
    the same way."""
    return f"{script} failed before it called distsgd ({what}); fix the script or its arguments"


def exited(exc: SystemExit) -> str:
    """A script's ``sys.exit`` in a few words: ``exit code 2``, ``exit: bad input``."""
    return f"exit code {exc.code}" if isinstance(exc.code, int) else f"exit: {exc.code}"


def after_training(script: str, what: str) -> int:
    """The script failed (``what``, its line named) after its training finished: its own
    error, not training's. Said in one line and recorded for the launcher, which does not
    restart it (training would be done again, and the run's result overwritten)."""
    message = (
        f"{script} failed after its training finished ({what}); fix the script (training is "
        "not run again)"
    )
    print(f"{SETUP_ERROR_PREFIX}{message}", file=sys.stderr)
    record_setup_error(SetupError(message), kind="after_training")
    return AFTER_TRAINING_EXIT_CODE


def raised(exc: BaseException, script: Path) -> str:
    """``exc`` in a few words, with the script's line it came from: ``NameError at line 3:
    name 'x' is not defined``."""
    line = exc.lineno if isinstance(exc, SyntaxError) else None
    if line is None:
        frames = traceback.extract_tb(exc.__traceback__)
        mine = [f for f in frames if Path(f.filename).resolve() == script.resolve()]
        line = mine[-1].lineno if mine else None
    where = "" if line is None else f" at line {line}"
    text = one_line(exc.msg if isinstance(exc, SyntaxError) else str(exc))
    return f"{type(exc).__name__}{where}" + (f": {text}" if text else "")


def refuse_setup(exc: SetupError) -> int:
    """Say ``exc`` in one line, leave its record for the launcher, and give the exit code
    that the launcher does not restart."""
    print(f"{SETUP_ERROR_PREFIX}{exc}", file=sys.stderr)
    record_setup_error(exc)
    return SETUP_EXIT_CODE


def record_setup_error(
    exc: SetupError, environ: Mapping[str, str] | None = None, *, kind: ErrorKind = "setup"
) -> None:
    """Leave ``exc`` as this task's :class:`SetupErrorRecord` in its run folder, for the
    launcher to report (``kind``: a setup error, the script's error after its training
    finished, or one it raised while training);
    nothing when the task has no run folder (a script run alone)."""
    from distsgd.control.task import TaskEnv  # here: ``distsgd server`` imports this module

    try:
        env = TaskEnv.from_environ(environ)
    except (ValueError, TypeError):  # a damaged DISTSGD_TASK: the training said so already
        return
    if env is None or not env.run_dir or env.standalone_run:
        return
    files = from_environ(env.run_dir, env.control, environ)
    assert files is not None  # a run folder, here or the launcher's
    try:
        SetupErrorRecord(task=env.task, message=str(exc), kind=kind).save(files)
        files.close()
    except (OSError, RuntimeError) as err:  # a full disk, a launcher that does not answer
        logging.getLogger(__name__).warning("could not record the setup error: %s", err)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tie_to_parent()
    limit_threads()
    setup_logging()
    if not argv:
        print("usage: python -m distsgd.launcher.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    return run_script(argv[0], argv[1:])


def exit_now(code: int) -> None:
    """End this task process with ``code`` once its output is flushed, without interpreter
    finalization: a finished worker has written everything it owns (atomically), and running
    C++ destructors of a torch.distributed group whose peers are exiting too can abort the
    process (see ``runtime.collective.Collective.leave``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
