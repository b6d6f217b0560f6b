"""``distsgd compare``: several schemes, one after the other, on the same script, data and seed.

Each entry of ``--schemes`` (:mod:`distsgd.schemes.entries`) runs through
:func:`distsgd.launcher.run.launch` (the launcher of ``distsgd run``) into
``OUT/runs/<folder>/``, with its launcher output in ``OUT/runs/<folder>/launcher.log``.
Then :mod:`distsgd_compare.report` writes ``compare.md`` and ``compare.json`` into ``OUT``, and
:mod:`distsgd_compare.figure` ``compare.png`` where matplotlib is installed (the ``compare``
extra; without it compare says so in one line on standard error before the first run, and
writes the other two). A scheme whose run fails is reported as failed and the others still
run; Ctrl-C stops the current run (the launcher stops its tasks) and the rest are skipped.

Curves need evaluations during the run, every ``eval_every`` local steps of the chief. Unless
``--eval-every`` is given, compare picks it so that each curve has about ``points`` (20)
evaluations: from ``--steps`` when given; otherwise the step count is known only once a run
has finished, so the first run evaluates every :data:`PROVISIONAL_EVAL_EVERY` steps, and if that
gave fewer than ``points / 2`` or more than ``2.5 * points`` evaluations, that run is repeated
(the first try moves to ``OUT/pilot/<folder>``) with the calibrated value, which every later
scheme uses as well: all schemes of a comparison evaluate equally often.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from distsgd.control.outcome import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    RunOutcome,
    RunStatus,
)
from distsgd.launcher.progress import Console
from distsgd.launcher.run import launch
from distsgd.schemes.entries import SchemeEntry
from distsgd_compare.config import CompareConfig
from distsgd_compare.figure import missing_figure_reason, write_figure
from distsgd_compare.folders import UNSAFE
from distsgd_compare.report import Context, write_json, write_markdown
from distsgd_compare.summary import SchemeRun, default_target, summarize, with_target
from distsgd_compare.tune import STALLED, Trial, pick_best, setting_text

log = logging.getLogger(__name__)

PROVISIONAL_EVAL_EVERY = 16
"""Evaluation interval of the first run when the step count is not known in advance."""

FIGURE, TABLE, DATA = "compare.png", "compare.md", "compare.json"


def run_status(outcome: RunOutcome) -> str:
    """A launch's status as a compare row says it: ok, failed (a setup error too), diverged
    (not learning too: the row then says 'did not learn', read from result.json) or
    interrupted."""
    if outcome.status in (RunStatus.DIVERGED, RunStatus.STALLED):
        return "diverged"
    if outcome.status is RunStatus.SETUP_ERROR:
        return "failed"
    return str(outcome.status.value)


def _calibrated(local_steps: int, eval_every: int, points: int) -> int | None:
    """A better ``eval_every`` when ``eval_every`` gave far from ``points`` evaluations."""
    if not local_steps or eval_every <= 0:
        return None
    count = local_steps // eval_every
    if points / 2 <= count <= points * 2.5:
        return None
    better = max(1, round(local_steps / points))
    return None if better == eval_every else better


def _machine() -> dict[str, Any]:
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    return {
        "cores": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch_version,
    }


class Comparison:
    """One ``distsgd compare``: its runs in order, then its reports."""

    def __init__(self, config: CompareConfig, console: Console) -> None:
        self.config = config
        self.console = console
        self.out = config.resolved_out()
        planned = config.planned_eval_every()
        self.calibrated = planned is not None
        self.eval_every = PROVISIONAL_EVAL_EVERY if planned is None else planned
        self.runs: list[SchemeRun] = []
        self.no_figure: str | None = None
        """Why ``compare.png`` cannot be drawn (matplotlib missing); None when it can."""

    def _say(self, text: str) -> None:
        self.console.note(f"[compare] {text}")

    def run(self) -> int:
        c = self.config
        (self.out / "runs").mkdir(parents=True, exist_ok=True)
        self.no_figure = missing_figure_reason()
        if self.no_figure is not None:  # said before the runs: install now or go without
            self.console.error(f"distsgd compare: {self.no_figure}")
        how = (
            f"every {self.eval_every} local steps"
            if self.calibrated
            else f"every {self.eval_every} local steps until the first run tells the step count"
        )
        fair = ""
        if c.tune_keys:
            fair += (
                f"; tuning {', '.join(k.name for k in c.tune_keys)} on a "
                f"{c.validation_fraction:g} validation split of the training set"
            )
        if c.repeats > 1:
            fair += f"; {c.repeats} runs per entry (seeds --seed + i)"
        self._say(
            f"{len(c.entries)} entries, {c.workers} workers, {c.script}; the chief evaluates "
            f"{how}{fair}; output in {self.out}"
        )
        self.interrupted = False
        self.terminated = False  # by SIGTERM: 143, not Ctrl-C's 130
        for index, entry in enumerate(c.entries):
            self.runs.extend(self._entry(index, entry))
        self._write_reports()
        if self.interrupted:
            return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED
        if any(r.status not in ("ok", "diverged") for r in self.runs):
            return EXIT_FAILED
        return EXIT_DIVERGED if any(r.status == "diverged" for r in self.runs) else EXIT_OK

    def _not_run(self, entry: SchemeEntry, reason: str, **fields: Any) -> SchemeRun:
        c = self.config
        return SchemeRun(
            scheme=entry.scheme,
            label=entry.label,
            status="not run",
            reason=reason,
            scheme_options=c.options_for(entry),
            overrides=c.overrides_for(entry),
            baseline=entry.baseline,
            **fields,
        )

    def _entry(self, index: int, entry: SchemeEntry) -> list[SchemeRun]:
        """An entry's tuning runs (if any), then its final runs."""
        c = self.config
        where = f"{index + 1}/{len(c.entries)} {entry.label}"
        if self.interrupted:
            return [self._not_run(entry, "interrupted")]
        settings = c.grid_for(entry)
        chosen: dict[str, Any] = {}
        trials: list[Trial] = []
        if settings:
            seed = c.seeds(entry)[0]
            for n, setting in enumerate(settings):
                text = setting_text(setting)
                extra: dict[str, Any] = {"validation": c.validation_fraction}
                if seed is not None:
                    extra["seed"] = seed
                run = self._run(
                    entry,
                    f"{where} tune {n + 1}/{len(settings)} {text}",
                    Path("tune") / entry.folder / UNSAFE.sub("-", text),
                    setting=setting,
                    extra=extra,
                )
                trials.append(
                    Trial(
                        setting=setting,
                        status=STALLED if run.stalled else run.status,
                        accuracy=run.final_accuracy,
                        loss=run.final_test_loss,
                        run_dir=run.run_dir,
                    )
                )
                if run.status == "interrupted":
                    self.interrupted = True
                    return [self._not_run(entry, "interrupted", trials=trials)]
            best = pick_best(trials)
            if best is None:
                self._say(f"{where}: no tuning run finished; its final runs are skipped")
                return [self._not_run(entry, "no tuning run finished", trials=trials)]
            chosen = best.setting
            self._say(f"{where}: chose {setting_text(chosen)} ({_score(best)} on validation)")
        runs: list[SchemeRun] = []
        seeds = c.seeds(entry)
        for i, seed in enumerate(seeds):
            if self.interrupted:
                runs.append(self._not_run(entry, "interrupted", tuned=chosen, trials=trials))
                continue
            folder = Path("runs") / entry.folder
            if len(seeds) > 1:
                folder = folder / f"seed{seed}"
            label = where if len(seeds) == 1 else f"{where} seed {seed} ({i + 1}/{len(seeds)})"
            run = self._run(
                entry,
                label,
                folder,
                setting=chosen,
                extra={} if seed is None else {"seed": seed},
            )
            run = dataclasses.replace(run, tuned=chosen, trials=trials, repeat=i)
            runs.append(run)
            self.interrupted = run.status == "interrupted"
        return runs

    def _run(
        self,
        entry: SchemeEntry,
        where: str,
        folder: Path,
        *,
        setting: dict[str, Any],
        extra: dict[str, Any],
    ) -> SchemeRun:
        """One run of an entry into ``OUT/folder``; the first run of a comparison without a
        planned ``eval_every`` calibrates it (and is repeated if it must)."""
        c = self.config
        run_dir = self.out / folder
        launch_config = c.launch_config(
            entry, run_dir, self.eval_every, setting=setting, extra=extra
        )
        self._say(
            f"{where}: starting ({launch_config.size.workers} workers, {launch_config.num_ps} ps) "
            f"in {run_dir}"
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(run_dir / "launcher.log", "w", encoding="utf-8") as stream:
            try:
                outcome = launch(launch_config, Console(stream))
            except Exception as exc:  # a scheme that cannot run must not stop the others
                log.debug("%s: launch raised", entry.label, exc_info=True)
                stream.write(f"distsgd: error: {exc}\n")
                outcome = RunOutcome(
                    status=RunStatus.FAILED, run_dir=run_dir, reason=str(exc).split("\n")[0]
                )
        wall = time.monotonic() - started
        self.terminated = self.terminated or outcome.exit_code == EXIT_TERMINATED
        status = run_status(outcome)
        reason = outcome.explanation() if status in ("failed", "diverged") else ""
        run = summarize(
            entry.scheme,
            run_dir,
            label=entry.label,
            scheme_options=launch_config.scheme_options,
            overrides=launch_config.overrides,
            status=status,
            reason=reason,
            parameter_servers=launch_config.num_ps,
            eval_every=launch_config.overrides["eval_every"],
            wall_seconds=wall,
        )
        run = dataclasses.replace(run, baseline=entry.baseline, workers=launch_config.size.workers)
        self._say(f"{where}: {_outcome(run, validation='validation' in extra)}")
        if run.status == "ok" and not self.calibrated:
            self.calibrated = True
            steps = run.local_steps or 0
            better = _calibrated(steps, self.eval_every, c.points)
            if better is not None:
                self._say(
                    f"{entry.label} ran {steps} local steps per worker: evaluating every "
                    f"{self.eval_every} gave {steps // self.eval_every} points; running it "
                    f"again evaluating every {better} (use --eval-every to skip this)"
                )
                pilot = self.out / "pilot" / folder.relative_to(folder.parts[0])
                pilot.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(run.run_dir, pilot)
                self.eval_every = better
                return self._run(entry, where, folder, setting=setting, extra=extra)
        return run

    def _write_reports(self) -> None:
        c = self.config
        measured = any(r.curves.has_accuracy or r.final_accuracy is not None for r in self.runs)
        target = c.target if c.target is not None and measured else default_target(self.runs)
        self.runs = [with_target(r, target) for r in self.runs]
        seeds = sorted({r.seed for r in self.runs if r.seed is not None})
        varied = c.repeats > 1 or any("seed" in e.overrides for e in c.entries)
        seed = None if varied else c.overrides.get("seed", seeds[0] if seeds else None)
        first = c.launch_config(c.entries[0], self.out, self.eval_every)
        context = Context(
            command=c.command,
            label=c.label or Path(c.script).name,
            workers=c.workers,
            ps=c.ps,
            seed=seed,
            target=target,
            target_source="--target"
            if c.target is not None
            else "95% of the best final accuracy; set it with --target",
            eval_every=self.eval_every,
            threads_per_worker=first.threads_per_worker,
            machine=_machine(),
            figure=self.no_figure is None,
            repeats=c.repeats,
            tune=tuple(setting_text({k.name: ",".join(map(str, k.values))}) for k in c.tune_keys),
            validation=c.validation_fraction if c.tune_keys else 0.0,
        )
        paths = (
            *([(self.out / FIGURE, write_figure)] if context.figure else []),
            (self.out / TABLE, write_markdown),
            (self.out / DATA, write_json),
        )
        for path, write in paths:
            write(path, context, self.runs)
            self._say(f"wrote {path}")


def _score(trial: Trial) -> str:
    if trial.accuracy is not None:
        return f"accuracy {trial.accuracy:.4f}"
    return f"loss {trial.loss:.4f}" if trial.loss is not None else "no score"


def _outcome(run: SchemeRun, *, validation: bool = False) -> str:
    wall = f"{run.wall_seconds:.0f}s" if run.wall_seconds is not None else "?"
    on = "validation" if validation else "test"
    if run.status in ("ok", "diverged"):
        score = (
            f"{on} accuracy {run.final_accuracy:.4f}"
            if run.final_accuracy is not None
            else f"{on} loss {run.final_test_loss:.4f}"
            if run.final_test_loss is not None
            else "no test score"
        )
        train = f"{run.train_seconds:.1f}s" if run.train_seconds is not None else "?"
        bad = "DID NOT LEARN" if run.stalled else "DIVERGED"
        done = "done" if run.status == "ok" else f"{bad} ({run.reason})"
        return f"{done}, {score}, {train} of training ({wall} with start-up)"
    if run.status == "interrupted":
        return f"interrupted after {wall}; the remaining runs are skipped"
    return f"FAILED after {wall}: {run.reason}"


def compare(config: CompareConfig, console: Console | None = None) -> int:
    """Run every scheme of ``config``, write the reports; 0, 1 (a run failed), 3 (none failed
    but one diverged), 130 (Ctrl-C) or 143 (SIGTERM)."""
    return Comparison(config, console or Console()).run()
