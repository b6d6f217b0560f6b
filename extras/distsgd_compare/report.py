"""The tables of ``distsgd compare``: ``compare.md`` (one row per entry of ``--schemes``, then
how the numbers were made) and ``compare.json`` (the same numbers and the curves), from the
runs' summaries (:mod:`distsgd_compare.summary`).

The runs of one entry (its ``--repeats``, several seeds) share its label: :func:`groups`
gathers them, and the row shows their mean ± the sample standard deviation (min and max are
in ``compare.json``'s ``entries``). Every row ends with the entry's effective settings
(:func:`settings_text`) and what ``--tune`` chose on the validation split.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.util import write_atomic
from distsgd_compare.summary import SchemeRun
from distsgd_compare.tune import Spread, Trial, setting_text, spread


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the whole comparison was: shown above the table and in the figure's title."""

    command: str
    label: str
    workers: int
    ps: int | None
    seed: int | None
    """The seed of every run (None: unknown, or entries set their own)."""
    target: float | None
    target_source: str
    eval_every: int
    threads_per_worker: int
    machine: dict[str, Any]
    figure: bool = True
    """Whether ``compare.png`` was drawn (it needs matplotlib, the ``compare`` extra)."""
    repeats: int = 1
    """Final runs per entry (seeds ``--seed + i``)."""
    tune: tuple[str, ...] = ()
    """The ``--tune`` flags as parsed (``lr=0.05,0.15``)."""
    validation: float = 0.0
    """The held-out fraction of the training set the tuning runs scored on (0: no tuning)."""


SPREAD = "mean ± std"
"""What a cell of several runs shows: their mean ± the sample standard deviation (n - 1)."""

_SHOWN = ("lr", "momentum", "batch_size")
"""TrainConfig fields every row's settings show (others only when given)."""
_HIDDEN = {"eval_every", "seed", "validation"}


def groups(runs: Sequence[SchemeRun]) -> list[list[SchemeRun]]:
    """The runs of each entry (same label), in the order the entries first appear."""
    by_label: dict[str, list[SchemeRun]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    return list(by_label.values())


def _spec(scheme: str) -> schemes.SchemeSpec | None:
    try:
        return schemes.get(scheme)
    except ValueError:
        return None


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def rate_text(run: SchemeRun, star: str = "") -> str:
    """``lr`` as applied: ``lr=0.1`` where the run took it as given, ``lr=0.1 x 4 = 0.4
    (linear)`` where its ``--lr-rule`` scaled it (``result.json``'s ``lr_scaling``)."""
    scaling = run.lr_scaling
    given = scaling.get("lr", run.train_config.get("lr", run.overrides.get("lr")))
    if given is None:
        return ""
    factor, applied = scaling.get("factor"), scaling.get("effective_lr")
    if not isinstance(factor, int | float) or not isinstance(applied, int | float) or factor == 1:
        return f"lr={_short(given)}{star}"
    return f"lr={_short(given)}{star} x {factor:.3g} = {applied:.3g} ({scaling.get('rule', '?')})"


def settings_text(run: SchemeRun, workers: int | None = None) -> str:
    """The settings the run trained with: lr as applied (the given rate and what its rule made
    of it) and momentum where the scheme uses them (not DiLoCo's, whose rates are its own
    options), the batch size, the scheme's step-size options (defaults too), other training
    fields and options given that differ from the scheme's defaults, the workers; a tuned value
    is marked with ``*``."""
    config = {**run.train_config}
    spec = _spec(run.scheme)
    # the settings that set how far the scheme's updates move (``SchemeSpec.step_size``)
    step_size = spec.step_size if spec else ("lr",)
    unused = set() if "lr" in step_size else {"lr", "momentum"}
    given = {k: v for k, v in run.overrides.items() if k not in _HIDDEN | unused}
    star = {key: "*" if key in run.tuned else "" for key in {*given, *run.scheme_options, "lr"}}
    parts = []
    for key in _SHOWN:
        value = config.get(key, given.get(key))
        if key in unused or value is None:
            continue
        text = rate_text(run, star["lr"]) if key == "lr" else f"{key}={_short(value)}"
        parts.append(text + ("" if key == "lr" else star.get(key, "")))
    for key, value in given.items():
        if key not in _SHOWN:
            parts.append(f"{key}={_short(value)}{star[key]}")
    defaults = {f.name: f.default for f in fields(spec.options)} if spec else {}
    for key in step_size:  # what sets the step is shown whether given or not
        value = run.scheme_options.get(key, defaults.get(key))
        if key not in _SHOWN and value is not None:
            parts.append(f"{key}={_short(value)}{star.get(key, '')}")
    for key, value in run.scheme_options.items():
        if key not in step_size and (key in run.tuned or defaults.get(key, object()) != value):
            parts.append(f"{key}={_short(value)}{star[key]}")
    count = run.workers or workers
    if count:
        parts.append(f"{count} worker{'s' if count != 1 else ''}")
    return ", ".join(parts)


def _trial_score(trial: Trial) -> str:
    if trial.status != "ok":
        return trial.status
    if trial.accuracy is not None:
        return f"{trial.accuracy:.4f}"
    return f"loss {trial.loss:.4f}" if trial.loss is not None else "no score"


def tuning_text(run: SchemeRun) -> str:
    """What ``--tune`` chose for the run's entry, and each setting's validation score."""
    if not run.trials:
        return ""
    tried = "; ".join(f"{setting_text(t.setting)}: {_trial_score(t)}" for t in run.trials)
    chosen = setting_text(run.tuned) if run.tuned else "none finished"
    return f"**{chosen}** ({tried})"


def _mean(values: Sequence[float | None], digits: int) -> str:
    got = spread(values)
    if got is None:
        return "n/a"
    return f"{got.mean:.{digits}f} ± {got.std:.{digits}f}"


def _megabytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    mb = n / 1e6
    return f"{mb:.2f} MB" if mb < 10 else f"{mb:.1f} MB"


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _staleness(run: SchemeRun) -> str:
    if run.mean_staleness is not None:
        p99 = "" if run.staleness_p99 is None else f" (p99 {run.staleness_p99})"
        return f"{run.mean_staleness:.2f}{p99}"
    if run.parameter_servers == 0 and run.status == "ok":
        return "n/a (no parameter servers)"
    return "n/a"


def _steps(run: SchemeRun) -> str:
    if run.global_step is None or run.local_steps is None:
        return "n/a"
    return f"{run.global_step} / {run.local_steps}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(group: Sequence[SchemeRun], target: float | None, workers: int | None = None) -> str:
    run = group[0]
    tail = [settings_text(run, workers), tuning_text(run)]
    if len(group) > 1:
        return _group_row(group, target, tail)
    if run.status not in ("ok", "diverged"):
        why = f"{run.status}: {run.reason}" if run.reason else run.status
        cells = [f"`{run.label}`", f"**{why}**", *["" for _ in range(7)], *tail, ""]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"
    if target is None:
        reach = "n/a (no accuracy)"
    elif run.seconds_to_target is None:
        reach = "not reached"
    else:
        reach = f"{run.seconds_to_target:.1f}"
    rolled = f" (rolled back {run.rollbacks}x)" if run.rollbacks else ""
    cells = [
        f"`{run.label}`",
        f"ok{rolled}"
        if run.status == "ok"
        else f"**{'did not learn' if run.stalled else 'diverged'}**{rolled}: {run.reason}",
        _number(run.final_accuracy),
        _number(run.final_test_loss),
        reach,
        _number(run.train_seconds, 1),
        _megabytes(run.bytes_sent),
        _staleness(run),
        _steps(run),
        *tail,
        _stragglers([run]),
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _stragglers(runs: Sequence[SchemeRun]) -> str:
    """The stragglers named in these runs (``worker2 (compute)``, each once), or none."""
    named = list(dict.fromkeys(s for run in runs for s in run.stragglers))
    return ", ".join(named) if named else "none"


def _status(group: Sequence[SchemeRun]) -> str:
    counts = Counter(run.status for run in group)
    rolled = sum(1 for run in group if run.rollbacks)
    if set(counts) == {"ok"}:
        return f"ok ({len(group)} runs{f', {rolled} rolled back' if rolled else ''})"
    text = ", ".join(f"{n} {status}" for status, n in counts.items())
    reasons = sorted({r.reason for r in group if r.status != "ok" and r.reason})
    return f"**{text}**" + (f": {reasons[0]}" if reasons else "")


def _group_row(group: Sequence[SchemeRun], target: float | None, tail: list[str]) -> str:
    done = [r for r in group if r.status in ("ok", "diverged")]
    if target is None:
        reach = "n/a (no accuracy)"
    else:
        reached = [r.seconds_to_target for r in done if r.seconds_to_target is not None]
        reach = (
            f"{_mean(reached, 1)} ({len(reached)}/{len(group)} reached)"
            if reached
            else "not reached"
        )
    sent = spread([r.bytes_sent for r in done])
    stale = spread([r.mean_staleness for r in done])
    cells = [
        f"`{group[0].label}`",
        _status(group),
        _mean([r.final_accuracy for r in done], 4),
        _mean([r.final_test_loss for r in done], 4),
        reach,
        _mean([r.train_seconds for r in done], 1),
        _megabytes(None if sent is None else round(sent.mean)),
        "n/a" if stale is None else f"{stale.mean:.2f}",
        _steps(done[0]) if done else "n/a",
        *tail,
        _stragglers(done),
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def entry_summary(group: Sequence[SchemeRun]) -> dict[str, Any]:
    """compare.json's ``entries`` item: an entry's label, settings, tuning and the spread
    (mean, sample std, min, max, n) of its runs' final numbers."""
    run = group[0]

    def numbers(values: Sequence[float | None]) -> dict[str, Any] | None:
        got: Spread | None = spread(values)
        return None if got is None else asdict(got)

    done = [r for r in group if r.status in ("ok", "diverged")]
    return {
        "label": run.label,
        "scheme": run.scheme,
        "baseline": run.baseline,
        "settings": settings_text(run),
        "tuned": run.tuned,
        "trials": [asdict(t) for t in run.trials],
        "seeds": [r.seed for r in group],
        "statuses": [r.status for r in group],
        "final_accuracy": numbers([r.final_accuracy for r in done]),
        "final_test_loss": numbers([r.final_test_loss for r in done]),
        "train_seconds": numbers([r.train_seconds for r in done]),
        "seconds_to_target": numbers([r.seconds_to_target for r in done]),
        "bytes_sent": numbers([r.bytes_sent for r in done]),
    }


def ps_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    counts = sorted({r.parameter_servers for r in runs if r.parameter_servers})
    if not counts:
        return "no parameter servers"
    return f"{', '.join(map(str, counts))} ps (parameter-server schemes only)"


def _seed_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    if context.seed is not None:
        return f"seed {context.seed}"
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    if len(seeds) > 1 and context.repeats > 1:
        return f"seeds {', '.join(map(str, seeds))} (--repeats {context.repeats}: --seed + i)"
    if len(seeds) > 1:
        return f"seeds {', '.join(map(str, seeds))} (entries set their own)"
    return f"seed {seeds[0]}" if seeds else "seed n/a"


def markdown(context: Context, runs: Sequence[SchemeRun]) -> str:
    """``compare.md``: one row per entry of ``--schemes``, then how the numbers were made."""
    target = context.target
    target_head = "s to target" if target is None else f"s to {target:.2f}"
    grouped = groups(runs)
    many = any(len(g) > 1 for g in grouped)
    each = f" ({SPREAD})" if many else ""
    head = [
        "scheme",
        "status",
        f"final accuracy{each}",
        f"final test loss{each}",
        f"{target_head}{each}",
        f"training s{each}",
        "sent (all workers)",
        "mean staleness",
        "steps (global / per worker)",
        "settings (* = tuned)",
        f"tuned on validation ({context.validation:g} of train)" if context.tune else "tuned",
        "stragglers",
    ]
    fair = []
    if many:
        fair.append(
            f"- {SPREAD}: the mean and sample standard deviation over an entry's "
            f"{context.repeats} runs, seeds --seed + i (min and max: compare.json, entries)"
        )
    if context.tune:
        fair.append(
            f"- --tune {' --tune '.join(context.tune)}: each entry ran every setting on the "
            f"training set less a held-out {context.validation:g} of it (the same samples for "
            "all runs), scored by the final validation accuracy (loss without accuracy), and "
            "its final runs used the best one, the whole training set and the test set; "
            "the test set was never read while tuning"
        )
    if any(r.baseline for r in runs):
        fair.append(
            "- 1 worker (allreduce): the same script on one worker, over the same total "
            "samples (--steps times the workers; --epochs count all workers together)"
        )
    machine = context.machine
    lines = [
        f"# distsgd compare: {', '.join(g[0].label for g in grouped)}",
        "",
        f"{context.label}; {context.workers} workers, {ps_text(context, runs)}; "
        f"{_seed_text(context, runs)}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
        *[_row(g, target, context.workers) for g in grouped],
        "",
        f"- command: `{context.command}`",
        f"- machine: {machine.get('cores')} cores ({machine.get('platform')}), "
        f"{context.threads_per_worker} torch threads per worker, Python "
        f"{machine.get('python')}, torch {machine.get('torch')}",
        "- target accuracy: "
        + ("n/a (the script reports no accuracy)" if target is None else f"{target:.2f} ")
        + (f"({context.target_source})" if target is not None else ""),
        f"- the chief evaluated every {context.eval_every} local steps"
        if context.eval_every
        else "- the chief evaluated only at the end",
        "- seconds count from the start of training (start-up excluded); "
        "training s ends at the final evaluation; sent = bytes all workers sent; "
        "mean staleness = updates applied between a worker's pull and its push, "
        "averaged over pushes, and p99 its 99th percentile over every push (parameter-server "
        "schemes only); steps = global updates / "
        "local steps of worker0; stragglers = the tasks the launcher named slow, with their "
        "cause (docs/guide/slow-or-stuck.md)",
        *fair,
        "",
        *(["![curves](compare.png)", ""] if context.figure else []),
    ]
    return "\n".join(lines)


def write_markdown(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    write_atomic(path, markdown(context, runs))


def write_json(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.json``: the context; ``entries``, per entry its settings, tuning and the
    spread of its runs (:func:`entry_summary`); ``schemes``, per run its label, scheme, scheme
    options and training overrides, the table's numbers and its curves."""
    data = {
        "version": 1,
        **asdict(context),
        "entries": [entry_summary(g) for g in groups(runs)],
        "schemes": [asdict(r) for r in runs],
    }
    write_atomic(path, json.dumps(data, indent=1) + "\n")
