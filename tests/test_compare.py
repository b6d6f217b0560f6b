"""``distsgd compare`` and ``--help-scheme``: real runs on loopback (slow), the reports' numbers
from synthetic metrics, variants in --schemes, and bad input (one line, exit 2)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import io
import json
import re
import signal
import sys
from pathlib import Path

import loadclock
import pytest
import torch
from conftest import ROOT, SCRIPTS, alive, metrics, run_distsgd, task_pids, wait_for

from distsgd import api as api_module
from distsgd import schemes
from distsgd.cli import main as cli_main
from distsgd.cli.main import main
from distsgd.control.config import TrainConfig
from distsgd.control.folder import METRICS_FILE, RESULT_FILE
from distsgd.control.outcome import RunOutcome, RunStatus
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.progress import Console
from distsgd.runtime.validation import split_validation, validation_indices
from distsgd.schemes.entries import parse_entry, split_schemes
from distsgd_compare import run as compare_module
from distsgd_compare.config import BASELINE_LABEL, CompareConfig
from distsgd_compare.figure import band, legend_label, missing_figure_reason, write_figure
from distsgd_compare.folders import FOLDER_LIMIT
from distsgd_compare.report import Context, markdown, write_json
from distsgd_compare.run import _calibrated
from distsgd_compare.summary import (
    Curves,
    SchemeRun,
    build_curves,
    mean_staleness,
    seconds_to,
    staleness_quantile,
    training_origin,
    with_target,
)
from distsgd_compare.tune import Trial, parse_tune, pick_best

BLOBS = str(SCRIPTS / "blobs.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

PICKY = f"""
import json, os, runpy, sys
if json.loads(os.environ["DISTSGD_TASK"])["scheme"] == "dynsgd":
    raise SystemExit("boom: this script refuses dynsgd")
sys.argv = [{BLOBS!r}, *sys.argv[1:]]
runpy.run_path({BLOBS!r}, run_name="__main__")
"""
"""blobs.py, except that it fails at once under dynsgd."""


def _compare(tmp_path: Path, *args: str, timeout: float = 200.0):  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    return out, run_distsgd(
        ["compare", "--workers", "2", "--out", str(out), *args], timeout=timeout, cwd=tmp_path
    )


def _rows(markdown: str) -> dict[str, list[str]]:
    """scheme -> cells of its table row."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _context(*, command: str, label: str, workers: int, eval_every: int = 4) -> Context:
    """A report context for report tests (seed 0, no target, a 2-core machine)."""
    return Context(
        command=command,
        label=label,
        workers=workers,
        ps=None,
        seed=0,
        target=None,
        target_source="",
        eval_every=eval_every,
        threads_per_worker=1,
        machine={"cores": 2},
    )


def _no_process_left(run_dir: Path) -> None:
    pids = list(task_pids(run_dir).values())
    assert wait_for(lambda: alive(pids) == [], 10), f"left behind: {alive(pids)}"


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_compare_writes_figure_table_and_json_and_survives_a_failed_scheme(
    tmp_path: Path,
) -> None:
    script = tmp_path / "picky.py"
    script.write_text(PICKY)
    out, done = _compare(
        tmp_path,
        *("--schemes", "hogwild(lr=0.1),dynsgd,allreduce", "--eval-every", "4"),
        *(str(script), "--steps", "40"),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any("1/3 hogwild(lr=0.1): starting" in line for line in lines)
    assert any("2/3 dynsgd: FAILED" in line for line in lines)
    assert any("3/3 allreduce: done, test accuracy" in line for line in lines)
    assert lines[-1].endswith("compare.json")

    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    table = (out / "compare.md").read_text()
    assert table.startswith("# distsgd compare: hogwild(lr=0.1), dynsgd, allreduce\n")
    assert "--schemes 'hogwild(lr=0.1),dynsgd,allreduce'" in table  # the command as given
    rows = _rows(table)
    assert list(rows) == ["hogwild(lr=0.1)", "dynsgd", "allreduce"]
    failed = rows.pop("dynsgd")[0]
    assert failed.startswith("**failed: worker")  # its setup failed: not restarted
    assert "boom: this script refuses dynsgd" in failed
    for cells in rows.values():
        assert cells[0] == "ok"
        assert 0.5 < float(cells[1]) <= 1.0  # final accuracy
        assert float(cells[2]) > 0  # final test loss
        assert float(cells[4]) > 0  # training seconds
        assert cells[5].endswith(" MB")
    assert rows["allreduce"][6].startswith("n/a")
    mean, p99 = re.fullmatch(r"([0-9.]+) \(p99 ([0-9]+)\)", rows["hogwild(lr=0.1)"][6]).groups()
    assert float(mean) <= int(p99) + 1  # measured staleness: the mean and the p99 of pushes
    assert "distsgd compare --workers 2" in table

    # the variant's lr reached its run, and only its run
    used = {
        folder: json.loads((out / "runs" / folder / "result.json").read_text())["config"]
        for folder in ("hogwild_lr=0.1", "allreduce")
    }
    assert used["hogwild_lr=0.1"]["lr"] == 0.1
    assert used["allreduce"]["lr"] == 0.05  # blobs.py's own

    data = json.loads((out / "compare.json").read_text())
    assert data["workers"] == 2 and data["eval_every"] == 4 and data["machine"]["cores"] >= 1
    assert [e["status"] for e in data["schemes"]] == ["ok", "failed", "ok"]
    assert [e["label"] for e in data["schemes"]] == ["hogwild(lr=0.1)", "dynsgd", "allreduce"]
    assert [e["scheme"] for e in data["schemes"]] == ["hogwild", "dynsgd", "allreduce"]
    assert data["schemes"][0]["overrides"] == {"lr": 0.1, "eval_every": 4}
    assert data["schemes"][2]["overrides"] == {"eval_every": 4}
    assert all(e["scheme_options"] == {} for e in data["schemes"])
    assert data["schemes"][0]["run_dir"] == str(out / "runs" / "hogwild_lr=0.1")
    for entry in data["schemes"]:
        _no_process_left(Path(entry["run_dir"]))
        if entry["status"] != "ok":
            continue
        assert entry["local_steps"] == 40 and entry["bytes_sent"] > 0
        curves = entry["curves"]
        assert len(curves["accuracy"]) == 40 // 4 + 1  # every 4 steps, and the final one
        assert curves["eval_samples"] == sorted(curves["eval_samples"])
        assert entry["samples"] == 2 * 40 * 16  # both workers, batch 16
        assert 40 * 16 < curves["eval_samples"][-1] <= 2 * 40 * 16
        assert curves["eval_seconds"][0] >= 0
        assert curves["train_loss"]


@pytest.mark.slow
def test_sigint_stops_the_current_run_and_skips_the_rest(spawn, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = spawn(
        [
            *("compare", "--schemes", "hogwild,allreduce", "--eval-every", "50"),
            *("--out", str(out), BLOBS, "--steps", "2000", "--slow", "0.01"),
        ]
    )
    run_dir = out / "runs" / "hogwild"
    assert wait_for(lambda: len(metrics(run_dir)) > 2, 60), "the first run did not start"
    proc.send_signal(signal.SIGINT)
    stdout, _ = loadclock.communicate(proc, 60)
    assert proc.returncode == 130, stdout[-3000:]
    _no_process_left(run_dir)
    assert not (out / "runs" / "allreduce").exists()
    rows = _rows((out / "compare.md").read_text())
    assert rows["hogwild"][0].startswith("**interrupted")
    assert rows["allreduce"][0].startswith("**not run")


@pytest.mark.slow
def test_a_real_tuned_repeated_comparison(tmp_path: Path) -> None:
    """``--tune`` and ``--repeats`` with real processes (small: blobs.py, 2 workers, 20 steps):
    the tuning runs hold out the validation part and pick the lr that learns, the final runs
    train on all of train_data with the chosen lr and seeds 0 and 1, and the table, the JSON
    and the figure show the choice and the mean ± std of the two final runs."""
    out, done = _compare(
        tmp_path,
        *("--schemes", "hogwild", "--tune", "lr=0.0001,0.2", "--repeats", "2", "--eval-every", "5"),
        *(BLOBS, "--steps", "20"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1/1 hogwild: chose lr=0.2 (accuracy" in done.stdout, done.stdout[-3000:]
    configs = {
        str(p.parent.relative_to(out)): json.loads(p.read_text())["config"]
        for p in out.rglob(RESULT_FILE)
    }
    assert sorted(configs) == [
        "runs/hogwild/seed0",
        "runs/hogwild/seed1",
        "tune/hogwild/lr=0.0001",
        "tune/hogwild/lr=0.2",
    ]
    for key, config in configs.items():
        tuning = key.startswith("tune/")
        assert config["validation"] == (0.2 if tuning else 0.0), (key, config)
        if not tuning:
            assert config["lr"] == 0.2 and config["seed"] == int(key[-1]), (key, config)
    assert configs["tune/hogwild/lr=0.0001"]["lr"] == 0.0001
    finals = [
        json.loads((out / "runs" / "hogwild" / f"seed{i}" / RESULT_FILE).read_text())
        for i in (0, 1)
    ]
    accuracies = [r["test_accuracy"] for r in finals]
    rows = _rows((out / "compare.md").read_text())
    hogwild = rows["hogwild"]
    assert hogwild[0] == "ok (2 runs)"
    mean, std = torch.tensor(accuracies).mean().item(), torch.tensor(accuracies).std().item()
    assert hogwild[1] == f"{mean:.4f} ± {std:.4f}", (hogwild[1], accuracies)
    assert hogwild[9].startswith("**lr=0.2** (lr=0.0001: "), hogwild[9]
    data = json.loads((out / "compare.json").read_text())
    entry = data["entries"][0]
    assert entry["tuned"] == {"lr": 0.2} and entry["seeds"] == [0, 1]
    assert entry["final_accuracy"]["n"] == 2
    if missing_figure_reason() is None:
        assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    for run_dir in out.glob("*/hogwild/*"):
        _no_process_left(run_dir)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--schemes", "hogwild,nope"], "unknown scheme 'nope'; choose one of: sync"),
        ([], "no schemes to compare; give --schemes"),
        (["--schemes", "hogwild,,allreduce"], "an empty name in --schemes"),
        (["--schemes", "hogwild,allreduce,hogwild"], "lists hogwild twice"),
        (["--schemes", "hogwild,allreduce", "--tau", "3"], "drop --tau or add easgd"),
        (["--schemes", "allreduce,localsgd", "--ps", "1"], "drop --ps"),
        (["--schemes", "hogwild,allreduce", "--lr", "-1"], "lr must be positive"),
        (["--schemes", "hogwild", "--target", "2"], "--target must be an accuracy"),
        # variants
        (["--schemes", "hogwild,downpour(server_lr=1"], "'downpour(server_lr=1': a '(' without"),
        (["--schemes", "downpour)x,hogwild"], "entry 'downpour)x': a ')' without its '('"),
        (["--schemes", "downpour(window=2)x"], "one pair of parentheses, at the end"),
        (["--schemes", "downpour(window=(2))"], "one pair of parentheses, at the end"),
        (["--schemes", "downpour()"], "nothing inside the parentheses; give KEY=VALUE pairs"),
        (["--schemes", "(lr=0.1)"], "no scheme name before '('"),
        (["--schemes", "downpour(server_lr)"], "'server_lr' has no '='; write KEY=VALUE, e.g."),
        (["--schemes", "downpour(=1)"], "'=1' has no key"),
        (["--schemes", "downpour(lr=0.1,,window=2)"], "an empty setting"),
        (["--schemes", "downpour(server_lr=)"], "server_lr has an empty value; give one, e.g."),
        (["--schemes", "downpour(window=1.5)"], "window=1.5 is not an integer; give an integer"),
        (["--schemes", "hogwild(lr=fast)"], "lr=fast is not a number; give a number, e.g. lr="),
        (["--schemes", "hogwild(lr=0.1,lr=0.2)"], "lr is given twice; give it once"),
        (["--schemes", "nope(lr=0.1)"], "'nope(lr=0.1)': unknown scheme 'nope'; choose one of"),
        (["--schemes", "hogwild(eval_every=2)"], "drop it from the entry and give --eval-every"),
        (["--schemes", "hogwild(lr=0.1),hogwild(lr=0.1)"], "lists hogwild(lr=0.1) twice"),
        (
            ["--schemes", "downpour(server_lr=1),downpour(server-lr=1.0)"],
            "lists downpour(server_lr=1) and downpour(server-lr=1.0), the same settings",
        ),
        (["--schemes", "hogwild(lr=-1)"], "hogwild(lr=-1): lr must be positive"),
        (["--schemes", "downpour(window=0)"], "downpour(window=0): window must be at least 1"),
        (["--schemes", "hogwild(lr=0.2),allreduce", "--tau", "3"], "drop --tau or add easgd"),
    ],
)
def test_bad_compare_arguments(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", "--out", str(tmp_path / "out"), *args, BLOBS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distsgd: error: "), err
    assert needle in err[0]
    assert not (tmp_path / "out").exists()


def test_compare_refuses_a_non_empty_out_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["compare", "--schemes", "hogwild", "--out", str(tmp_path), BLOBS]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists and is not empty" in err and "\n" not in err


def test_unknown_key_of_a_variant_lists_the_schemes_options_and_allows_train_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    train = ", ".join(
        f.name
        for f in dataclasses.fields(TrainConfig)
        if f.name not in ("eval_every", "validation")
    )
    for scheme in ("downpour", "hogwild"):
        assert main(["compare", "--schemes", f"{scheme}(speed=2)", BLOBS]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"distsgd: error: --schemes entry '{scheme}(")
        own = ", ".join(f.name for f in dataclasses.fields(schemes.get(scheme).options))
        if own:
            assert f"{scheme} has no option 'speed'; use one of its options ({own})" in err
        else:
            assert f"{scheme} has no options of its own" in err
        assert err.endswith(f"a TrainConfig field ({train})")


def test_a_shared_option_applies_to_each_listed_scheme_that_has_it() -> None:
    sharing = [(option, owners) for option, owners in _option_owners().items() if len(owners) > 1]
    if not sharing:
        pytest.skip("no option is shared by several schemes")
    option, owners = sharing[0]
    others = [n for n in schemes.names() if n not in owners and n != "sync"][:1]
    config = CompareConfig(
        schemes=(*owners, *others),
        script=BLOBS,
        scheme_options={option: getattr(_defaults(owners[0]), option)},
    )
    for name in owners:
        assert option in config.options_for(name)
    for name in others:
        assert config.options_for(name) == {}


def _option_owners() -> dict[str, list[str]]:
    owners: dict[str, list[str]] = {}
    for name in schemes.names():
        for f in dataclasses.fields(schemes.get(name).options):
            owners.setdefault(f.name, []).append(name)
    return owners


def _defaults(name: str):  # type: ignore[no-untyped-def]
    return schemes.get(name).options()


# ----------------------------------------------------------------------------- variants


EXAMPLE = "downpour,downpour(server_lr=1),hogwild(lr=0.15),diloco(outer_lr=1,outer_momentum=0)"


def test_split_respects_parentheses() -> None:
    assert split_schemes(EXAMPLE) == (
        "downpour",
        "downpour(server_lr=1)",
        "hogwild(lr=0.15)",
        "diloco(outer_lr=1,outer_momentum=0)",
    )
    assert split_schemes(" hogwild , sync( lr = 0.1 , momentum=0.5 ) ") == (
        "hogwild",
        "sync( lr = 0.1 , momentum=0.5 )",
    )
    assert split_schemes("") == ()
    assert split_schemes("hogwild,") == ("hogwild", "")  # -> "an empty name" later


def test_a_variant_sorts_its_settings_into_scheme_options_and_training_fields() -> None:
    entry = parse_entry("diloco(outer-lr=1,outer_momentum=0,batch-size=8,lr_schedule=cosine)")
    assert entry.scheme == "diloco"
    assert entry.label == "diloco(outer-lr=1,outer_momentum=0,batch-size=8,lr_schedule=cosine)"
    assert entry.options == {"outer_lr": 1.0, "outer_momentum": 0.0}
    assert entry.overrides == {"batch_size": 8, "lr_schedule": "cosine"}
    assert [type(v) for v in (*entry.options.values(), *entry.overrides.values())] == [
        float,
        float,
        int,
        str,
    ]
    # a str value may hold commas: sync's per-worker rates
    sync = parse_entry("sync(worker_lrs=0.1,0.2,backup_workers=0)")
    assert sync.options == {"worker_lrs": "0.1,0.2", "backup_workers": 0}
    plain = parse_entry(" hogwild ")
    assert (plain.label, plain.scheme, plain.options, plain.overrides) == (
        "hogwild",
        "hogwild",
        {},
        {},
    )


def test_a_variants_value_beats_the_global_flag() -> None:
    config = CompareConfig(
        schemes=("sync", "hogwild(lr=0.15)", "downpour", "downpour(window=7,seed=3)", "agn"),
        script=BLOBS,
        overrides={"lr": 0.3, "seed": 1},
        scheme_options={"window": 3},
    )
    launched = {e.label: config.launch_config(e, Path("r"), 5) for e in config.entries}
    assert launched["sync"].overrides == {"lr": 0.3, "seed": 1, "eval_every": 5}
    assert launched["hogwild(lr=0.15)"].overrides == {"lr": 0.15, "seed": 1, "eval_every": 5}
    # a global scheme flag still reaches every listed scheme that has it, unless the entry sets it
    assert launched["downpour"].scheme_options == {"window": 3}
    assert launched["downpour(window=7,seed=3)"].scheme_options == {"window": 7}
    assert launched["downpour(window=7,seed=3)"].overrides["seed"] == 3
    assert launched["agn"].scheme_options == {"window": 3}
    assert launched["sync"].scheme_options == {}


def test_the_cli_passes_variants_and_global_flags_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[CompareConfig] = []
    monkeypatch.setattr(compare_module, "compare", lambda config: seen.append(config) or 0)
    monkeypatch.chdir(tmp_path)  # were the stand-in not reached, the real run's --out stays here
    argv = ["compare", "--lr", "0.3", "--schemes", "sync,hogwild(lr=0.15)", "--out", "o", BLOBS]
    assert cli_main.main(argv) == 0
    (config,) = seen
    assert [e.label for e in config.entries] == ["sync", "hogwild(lr=0.15)"]
    assert config.overrides_for("sync")["lr"] == 0.3
    assert config.overrides_for("hogwild(lr=0.15)")["lr"] == 0.15
    assert "--schemes 'sync,hogwild(lr=0.15)'" in config.command


def test_labels_are_as_written_and_folders_safe_and_unique() -> None:
    long = "diloco(inner_steps=50,inner_lr=0.005,weight_decay=0.1,outer_lr=0.7,outer_momentum=0.9"
    texts = (
        *split_schemes(EXAMPLE),
        "hogwild( lr = 0.1 )",
        "sync(worker_lrs=0.1,0.2)",
        f"{long},fragments=1,lr=0.1)",
        f"{long},fragments=1,lr=0.2)",
    )
    config = CompareConfig(schemes=texts, script=BLOBS)
    assert [e.label for e in config.entries] == list(texts)
    folders = [e.folder for e in config.entries]
    assert folders[:6] == [
        "downpour",
        "downpour_server_lr=1",
        "hogwild_lr=0.15",
        "diloco_outer_lr=1_outer_momentum=0",
        "hogwild_lr=0.1",
        "sync_worker_lrs=0.1-0.2",
    ]
    # cut to FOLDER_LIMIT characters, the two long ones coincide: the second gets -2
    assert len(folders[6]) == FOLDER_LIMIT and folders[7] == folders[6] + "-2"
    assert len({f.casefold() for f in folders}) == len(folders)
    assert all(re.fullmatch(r"[A-Za-z0-9._=+-]+", f) for f in folders)


def test_reports_show_labels_and_each_runs_settings(tmp_path: Path) -> None:
    runs = [
        SchemeRun(scheme="downpour", status="ok", seed=0),
        SchemeRun(
            scheme="downpour",
            label="downpour(server_lr=1,seed=1)",
            status="failed",
            reason="boom",
            scheme_options={"server_lr": 1.0},
            overrides={"seed": 1, "eval_every": 4},
            seed=1,
        ),
    ]
    context = Context(
        command="distsgd compare --schemes 'downpour,downpour(server_lr=1,seed=1)'",
        label="blobs.py",
        workers=2,
        ps=None,
        seed=None,
        target=None,
        target_source="",
        eval_every=4,
        threads_per_worker=1,
        machine={"cores": 2},
    )
    text = markdown(context, runs)
    assert text.startswith("# distsgd compare: downpour, downpour(server_lr=1,seed=1)\n")
    assert list(_rows(text)) == ["downpour", "downpour(server_lr=1,seed=1)"]
    assert "seeds 0, 1" in text
    assert f"- command: `{context.command}`" in text
    write_json(tmp_path / "c.json", context, runs)
    entries = json.loads((tmp_path / "c.json").read_text())["schemes"]
    assert [(e["label"], e["scheme"]) for e in entries] == [
        ("downpour", "downpour"),
        ("downpour(server_lr=1,seed=1)", "downpour"),
    ]
    assert entries[1]["scheme_options"] == {"server_lr": 1.0}
    assert entries[1]["overrides"] == {"seed": 1, "eval_every": 4}


def test_compare_help_shows_the_variant_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = "".join(capsys.readouterr().out.split())
    assert "--schemesA,B(KEY=VALUE,...),..." in text
    assert "downpour(server_lr=1)" in text and "hogwild(lr=0.15)" in text


# ----------------------------------------------------------------------------- --help-scheme


@pytest.mark.parametrize("name", schemes.names())
def test_help_scheme_shows_docstring_and_own_defaults(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    spec = schemes.get(name)
    with pytest.raises(SystemExit) as stop:
        main(["run", "--help-scheme", name])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{name}: {spec.summary}")
    doc = sys.modules[spec.rules.__module__].__doc__ or ""
    assert doc.strip().splitlines()[0] in text
    for f in dataclasses.fields(spec.options):
        flag = "--" + f.name.replace("_", "-")
        assert f"{flag} {f.name.upper()}" in text
        assert f"(default {getattr(spec.options(), f.name)})" in text


@pytest.mark.parametrize("command", ["run", "demo", "compare"])
def test_help_scheme_of_an_unknown_scheme(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help-scheme", "nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distsgd: error: unknown scheme 'nope'; choose one of: ")
    assert "\n" not in err and "hogwild" in err


def test_help_of_a_shared_flag_names_each_schemes_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help-all"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even at hyphens
    for option, owners in _option_owners().items():
        if len(owners) > 1:
            defaults = ", ".join(f"{s} {getattr(_defaults(s), option)}" for s in owners)
            assert "".join(f"(default: {defaults}; see --help-scheme)".split()) in text, option


def test_the_scheme_list_mentions_help_scheme_name() -> None:
    done = run_distsgd(["run", "--help-scheme"])
    assert done.returncode == 0
    assert "distsgd run --help-scheme NAME" in done.stderr


# ----------------------------------------------------------------------------- the numbers


def _line(t: float, task: str, step: int, **fields: object) -> dict[str, object]:
    return {"time": t, "task": task, "local_step": step, "step": step, **fields}


def test_curves_sum_the_samples_of_all_workers_and_start_at_training() -> None:
    records = [
        _line(100.0, "worker0", 10, loss=2.0, samples=320, bytes_sent=10, mean_staleness=1.0),
        _line(100.5, "worker1", 10, loss=1.0, samples=320, bytes_sent=20, mean_staleness=3.0),
        _line(101.0, "worker0", 20, loss=1.0, samples=640, bytes_sent=30, mean_staleness=1.0),
        _line(101.1, "worker0", 20, test_loss=0.9, accuracy=0.7),
        _line(101.5, "worker1", 30, loss=0.5, samples=960, bytes_sent=40, mean_staleness=3.0),
        _line(102.0, "worker0", 20, test_loss=0.5, accuracy=0.9, final=True),
        _line(102.1, "launcher", 0, event="fault"),
    ]
    # worker0: 10 steps per second, so it began 1 s before its first line
    assert training_origin(records) == pytest.approx(99.0)
    curves = build_curves(records)
    # worker1 at 101.1 s is 60% of the way from 320 samples (100.5 s) to 960 (101.5 s)
    assert curves.eval_samples == [640 + 704, 640 + 960]
    assert curves.eval_seconds == pytest.approx([2.1, 3.0])
    assert curves.accuracy == [0.7, 0.9]
    assert curves.loss_samples == [320 + 0, 480 + 320, 640 + 640, 640 + 960]
    assert curves.train_loss[:2] == [2.0, 1.5]  # mean of each worker's latest loss
    assert seconds_to(curves, 0.8) == pytest.approx(3.0)
    assert seconds_to(curves, 0.95) is None
    # worker0 at 20 local steps with 1.0, worker1 at 30 with 3.0
    assert mean_staleness(records) == pytest.approx((20 * 1.0 + 30 * 3.0) / 50)


def test_the_staleness_quantile_merges_every_workers_histogram() -> None:
    result = {"staleness": {"worker0": {"0": 50, "1": 40}, "worker1": {"1": 9, "7": 1}}}
    assert staleness_quantile(result, 0.5) == 0
    assert staleness_quantile(result, 0.99) == 1  # 99 of 100 pushes at 1 or less
    assert staleness_quantile(result, 1.0) == 7
    assert staleness_quantile({}, 0.99) is None
    assert staleness_quantile({"staleness": {"worker0": {"x": 1}}}, 0.99) is None
    run = SchemeRun(scheme="hogwild", status="ok", mean_staleness=0.5, staleness_p99=1)
    from distsgd_compare.report import _staleness

    assert _staleness(run) == "0.50 (p99 1)"


def test_curves_of_a_run_without_metrics_are_empty() -> None:
    assert build_curves([]).eval_seconds == []
    assert mean_staleness([_line(1.0, "worker0", 10, loss=1.0, samples=1)]) is None


def test_reports_of_a_script_without_accuracy(tmp_path: Path) -> None:
    """A regression script: the figure plots test loss, the table says there is no target."""
    records = [
        _line(10.0 + i, f"worker{i % 2}", 10 * (1 + i // 2), loss=1.0 / (i + 1), samples=10 * i)
        for i in range(6)
    ]
    records.insert(3, _line(12.5, "worker0", 20, test_loss=0.5, accuracy=None))
    curves = build_curves(records)
    run = SchemeRun(scheme="hogwild", status="ok", parameter_servers=1, curves=curves)
    failed = SchemeRun(scheme="allreduce", status="failed", reason="task worker1 | died")
    context = _context(command="distsgd compare", label="reg.py", workers=2, eval_every=5)
    write_figure(tmp_path / "c.png", context, [run, failed])
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    text = markdown(context, [run, failed])
    rows = _rows(text)
    assert rows["hogwild"][3] == "n/a (no accuracy)"
    assert rows["allreduce"][0] == "**failed: task worker1 \\| died**"
    assert "target accuracy: n/a" in text


def test_calibration_aims_at_the_number_of_points() -> None:
    assert _calibrated(330, 16, 20) is None  # 20 points already
    assert _calibrated(40, 16, 20) == 2
    assert _calibrated(10_000, 16, 20) == 500
    assert _calibrated(0, 16, 20) is None


def test_failure_reason_is_the_error_and_the_tasks_last_log_line(tmp_path: Path) -> None:
    outcome = RunOutcome(
        status=RunStatus.FAILED,
        run_dir=tmp_path,
        reason="task worker1 failed (exit code 1)",
        log_tail=("Traceback (most recent call last):", "ValueError: bad", ""),
    )
    assert outcome.explanation() == "task worker1 failed (exit code 1): ValueError: bad"
    assert outcome.exit_code == 1
    assert compare_module.run_status(outcome) == "failed"


def test_a_diverged_run_is_marked_in_table_and_legend(tmp_path: Path) -> None:
    """A run the launcher named diverged keeps its numbers but says so in the table and in
    compare.json (the figure's legend labels it like any run not ok); the capture finds the
    reason in the launcher's outcome."""
    outcome = RunOutcome(
        status=RunStatus.DIVERGED,
        run_dir=tmp_path,
        reason="the final test accuracy 0.0944 is no better than chance (0.1167, ...)",
    )
    assert compare_module.run_status(outcome) == "diverged" and outcome.exit_code == 3
    reason = outcome.explanation()
    assert reason.startswith("the final test accuracy 0.0944 is no better than chance")
    runs = [
        SchemeRun(scheme="sync", status="ok", final_accuracy=0.97),
        SchemeRun(scheme="hogwild", status="diverged", reason=reason, final_accuracy=0.0944),
    ]
    context = _context(command="distsgd compare --schemes sync,hogwild", label="demo", workers=4)
    rows = _rows(markdown(context, runs))
    assert rows["sync"][0] == "ok"
    assert rows["hogwild"][0].startswith("**diverged**") and rows["hogwild"][1] == "0.0944"
    write_json(tmp_path / "c.json", context, runs)
    entries = json.loads((tmp_path / "c.json").read_text())["schemes"]
    assert [e["status"] for e in entries] == ["ok", "diverged"]


def test_a_run_that_did_not_learn_is_named_so(tmp_path: Path) -> None:
    """A run at chance whose parameters barely moved (``"stalled"`` in result.json): the
    capture finds the launcher's 'did not learn' line, the table and the progress line say
    'did not learn', and a tuning trial so is never chosen."""
    outcome = RunOutcome(
        status=RunStatus.STALLED,
        run_dir=tmp_path,
        reason="the final test accuracy 0.1000 is no better than chance (0.1167, ...), and the "
        "parameters moved only 0.03% of their size from where training started",
    )
    assert compare_module.run_status(outcome) == "diverged" and outcome.exit_code == 3
    reason = outcome.explanation()
    assert reason.startswith("the final test accuracy 0.1000") and "raise --lr" not in reason
    (tmp_path / RESULT_FILE).write_text(json.dumps({"test_accuracy": 0.1, "stalled": True}))
    (tmp_path / METRICS_FILE).write_text("")
    run = compare_module.summarize(
        "sync",
        tmp_path,
        label="sync",
        status="diverged",
        reason=reason,
        parameter_servers=1,
        eval_every=4,
        wall_seconds=3.0,
    )
    assert run.stalled
    context = _context(command="distsgd compare --schemes sync", label="demo", workers=8)
    assert _rows(markdown(context, [run]))["sync"][0].startswith("**did not learn**: the final")
    assert compare_module._outcome(run).startswith("DID NOT LEARN (the final test accuracy")
    trials = [
        Trial(setting={"lr": 0.03}, status=compare_module.STALLED, accuracy=0.1),
        Trial(setting={"lr": 0.3}, status="ok", accuracy=0.9),
    ]
    best = pick_best(trials)
    assert best is not None and best.setting == {"lr": 0.3}


@pytest.mark.parametrize(
    ("status", "cell"),
    [("ok", "ok (rolled back 2x)"), ("diverged", "**diverged** (rolled back 2x): why")],
)
def test_a_run_that_was_rolled_back_says_so_in_the_table(
    status: str, cell: str, tmp_path: Path
) -> None:
    """``result.json``'s ``rollbacks`` (docs/fault-tolerance.md) reach the table's status cell;
    a run without them reads as before."""
    rollbacks = [{"rollback": n, "lr_cut": 0.5**n} for n in (1, 2)]
    (tmp_path / RESULT_FILE).write_text(json.dumps({"test_accuracy": 0.9, "rollbacks": rollbacks}))
    (tmp_path / METRICS_FILE).write_text("")
    common = dict(label="sync", parameter_servers=1, eval_every=4, wall_seconds=3.0)
    run = compare_module.summarize("sync", tmp_path, status=status, reason="why", **common)
    assert run.rollbacks == 2
    context = _context(command="distsgd compare --schemes sync", label="demo", workers=2)
    assert _rows(markdown(context, [run]))["sync"][0] == cell
    (tmp_path / RESULT_FILE).write_text(json.dumps({"test_accuracy": 0.9, "rollbacks": "bad"}))
    plain = compare_module.summarize("sync", tmp_path, status="ok", **common)
    assert plain.rollbacks == 0 and _rows(markdown(context, [plain]))["sync"][0] == "ok"


# ----------------------------------------------------------------------------- matplotlib, an extra


def _without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here to the end of the test, importing matplotlib fails as where the ``compare``
    extra is not installed (``None`` in ``sys.modules`` makes ``import`` raise ImportError)."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _fake_launch(config: LaunchConfig, console: Console) -> RunOutcome:
    """A finished run in ``config.run_dir``: three worker lines and the chief's final
    evaluation (what the reports read), without starting any process."""
    lines = [
        _line(10.0 + i, "worker0", 4 * (i + 1), loss=1.0 / (i + 1), samples=64 * (i + 1))
        for i in range(3)
    ]
    lines.append(_line(13.5, "worker0", 12, test_loss=0.4, accuracy=0.9, final=True))
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (config.run_dir / METRICS_FILE).write_text(text)
    result = {"test_accuracy": 0.9, "test_loss": 0.4, "global_step": 12, "local_steps": 12}
    (config.run_dir / RESULT_FILE).write_text(json.dumps(result))
    return RunOutcome(status=RunStatus.OK, run_dir=config.run_dir)


def test_without_matplotlib_compare_writes_table_and_json_and_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _without_matplotlib(monkeypatch)
    reason = missing_figure_reason()
    assert reason is not None and "pip install 'distsgd[compare]'" in reason
    monkeypatch.setattr(compare_module, "launch", _fake_launch)
    out, said, errors = tmp_path / "out", io.StringIO(), io.StringIO()
    config = CompareConfig(
        schemes=("hogwild", "allreduce"), script=BLOBS, out=out, overrides={"steps": 12}
    )
    assert compare_module.compare(config, Console(said, errors=errors)) == 0
    assert errors.getvalue() == f"distsgd compare: {reason}\n"
    assert not (out / "compare.png").exists()
    assert "compare.png" not in said.getvalue()
    table = (out / "compare.md").read_text()
    assert list(_rows(table)) == ["hogwild", "allreduce"]
    assert _rows(table)["hogwild"][:2] == ["ok", "0.9000"]
    assert "compare.png" not in table  # no link to a figure that is not there
    data = json.loads((out / "compare.json").read_text())
    assert data["figure"] is False
    assert [e["final_accuracy"] for e in data["schemes"]] == [0.9, 0.9]


def test_with_matplotlib_compare_draws_the_figure_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same comparison where matplotlib is installed: nothing on stderr, compare.png."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(compare_module, "launch", _fake_launch)
    out, errors = tmp_path / "out", io.StringIO()
    config = CompareConfig(schemes=("hogwild",), script=BLOBS, out=out, overrides={"steps": 12})
    assert compare_module.compare(config, Console(io.StringIO(), errors=errors)) == 0
    assert errors.getvalue() == ""
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    assert "![curves](compare.png)" in (out / "compare.md").read_text()
    assert json.loads((out / "compare.json").read_text())["figure"] is True


def test_the_core_install_declares_no_matplotlib() -> None:
    """``pip install distsgd`` brings no matplotlib; the ``compare`` extra (and ``dev``) do."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def named(requirements: list[str]) -> bool:
        return any(re.match(r"matplotlib\b", r) for r in requirements)

    assert not named(project["dependencies"])
    assert named(project["optional-dependencies"]["compare"])
    assert named(project["optional-dependencies"]["dev"])
    # the installed metadata too, where it was built from this checkout
    dist = importlib.metadata.distribution("distsgd")
    origin = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if origin == ROOT.as_uri():
        core = [r for r in dist.requires or [] if "extra ==" not in r]
        assert core and not named(core)


def test_only_the_figure_module_imports_matplotlib_and_only_in_a_function() -> None:
    found: dict[str, list[bool]] = {}
    paths = [p for top in ("src", "emulate", "extras") for p in sorted((ROOT / top).rglob("*.py"))]
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if "matplotlib" not in text:
            continue  # no import of it can be in the tree (parsing all 232 files: 2 CPU-s)
        tree = ast.parse(text)
        in_functions = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "matplotlib" for n in names):
                rel = path.relative_to(ROOT).as_posix()
                found.setdefault(rel, []).append(id(node) in in_functions)
    assert set(found) == {"extras/distsgd_compare/figure.py"}, found
    assert all(all(inside) for inside in found.values()), found


# ----------------------------------------------------------------------------- fair comparisons


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tune", "speed=1,2"], "--tune speed: 'speed' is no training field and no option of"),
        (["--tune", "lr=0.1,fast"], "--tune lr: 'fast' is not a number; give numbers"),
        (["--tune", "batch_size=16,2.5"], "--tune batch_size: '2.5' is not an integer"),
        (["--tune", "lr"], "--tune 'lr': no '='; write KEY=V1,V2,..., e.g. lr=0.03,0.1,0.3"),
        (["--tune", "lr=0.1,,0.3"], "--tune 'lr=0.1,,0.3': an empty value"),
        (["--tune", "lr=0.1,0.1"], "a value is listed twice; give each value once"),
        (["--tune", "lr=0.1", "--tune", "lr=0.2"], "--tune lr is given twice"),
        (["--tune", "seed=1,2"], "--tune seed: not tunable (--repeats K runs each entry"),
        (["--tune", "lr=0.1,-1"], "sync with --tune lr=-1.0: lr must be positive"),
        (["--repeats", "0"], "--repeats must be at least 1, got 0; give --repeats 1"),
        (["--validation", "0.3"], "--validation is the held-out fraction of --tune's runs"),
        (["--baseline", "--workers", "1"], "--baseline with --workers 1: every run is one"),
    ],
)
def test_bad_fair_comparison_flags_say_cause_and_fix_in_one_line(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["compare", "--schemes", "sync,hogwild", "--out", str(tmp_path / "o"), *flags, BLOBS]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err, err
    assert not (tmp_path / "o").exists()


def test_tune_keys_make_a_grid_and_apply_where_they_fit() -> None:
    """A training field is tuned for every entry, a scheme option for the schemes that have it;
    an entry that fixes a key keeps it; the baseline is tuned like the others."""
    config = CompareConfig(
        schemes=("downpour", "hogwild(lr=0.15)"),
        script=BLOBS,
        tune=("lr=0.05,0.3", "server_lr=1,2"),
        baseline=True,
    )
    assert [k.name for k in config.tune_keys] == ["lr", "server_lr"]
    assert config.tune_keys[1].option and config.tune_keys[1].values == (1.0, 2.0)
    downpour, hogwild, baseline = config.entries
    assert config.grid_for(downpour) == [
        {"lr": 0.05, "server_lr": 1.0},
        {"lr": 0.05, "server_lr": 2.0},
        {"lr": 0.3, "server_lr": 1.0},
        {"lr": 0.3, "server_lr": 2.0},
    ]
    assert config.grid_for(hogwild) == []  # fixes lr itself, has no server_lr
    assert baseline.baseline and config.grid_for(baseline) == [{"lr": 0.05}, {"lr": 0.3}]
    run = config.launch_config(downpour, Path("."), 4, setting={"lr": 0.3, "server_lr": 2.0})
    assert run.scheme_options == {"server_lr": 2.0} and run.overrides["lr"] == 0.3
    assert config.validation_fraction == 0.2
    assert parse_tune(["momentum=0,0.9"], ["sync"])[0].values == (0.0, 0.9)


def test_the_baseline_runs_one_worker_over_the_same_samples() -> None:
    config = CompareConfig(
        schemes=("hogwild",), script=BLOBS, workers=4, baseline=True, overrides={"steps": 30}
    )
    baseline = config.entries[-1]
    assert baseline.label == BASELINE_LABEL and baseline.scheme == "allreduce"
    run = config.launch_config(baseline, Path("."), 5)
    assert (
        run.size.workers == 1
        and run.overrides["steps"] == 120
        and run.overrides["eval_every"] == 20
    )
    assert config.launch_config(config.entries[0], Path("."), 5).overrides["steps"] == 30


def test_seeds_of_the_repeats() -> None:
    entry = parse_entry("sync")
    seeds = CompareConfig(schemes=("sync",), script=BLOBS, repeats=3).seeds
    assert seeds(entry) == [0, 1, 2]
    with_seed = CompareConfig(schemes=("sync",), script=BLOBS, repeats=2, overrides={"seed": 7})
    assert with_seed.seeds(entry) == [7, 8]
    assert CompareConfig(schemes=("sync",), script=BLOBS).seeds(entry) == [None]  # the script's


def test_selection_picks_the_best_validation_score_of_finished_runs() -> None:
    trials = [
        Trial(setting={"lr": 0.05}, status="ok", accuracy=0.91, loss=0.3),
        Trial(setting={"lr": 0.15}, status="ok", accuracy=0.95, loss=0.2),
        Trial(setting={"lr": 0.2}, status="ok", accuracy=0.95, loss=0.1),  # a tie: first wins
        Trial(setting={"lr": 0.3}, status="diverged", accuracy=0.99, loss=0.05),
        Trial(setting={"lr": 0.6}, status="failed"),
    ]
    best = pick_best(trials)
    assert best is not None and best.setting == {"lr": 0.15}
    by_loss = [  # a script without accuracy: the lowest validation loss
        Trial(setting={"lr": 0.05}, status="ok", loss=0.3),
        Trial(setting={"lr": 0.15}, status="ok", loss=0.2),
    ]
    assert pick_best(by_loss) == by_loss[1]
    assert pick_best([Trial(setting={"lr": 1}, status="diverged", accuracy=0.5)]) is None


class _Untouchable(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A test set that fails the test if anything reads it."""

    def __len__(self) -> int:
        raise AssertionError("the test set was read")

    def __getitem__(self, index: int) -> object:
        raise AssertionError("the test set was read")


def test_the_validation_split_is_fixed_disjoint_and_never_reads_the_test_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keep, held = validation_indices(100, 0.2)
    assert len(held) == 20 and len(keep) == 80
    assert sorted(keep.tolist() + held.tolist()) == list(range(100))
    again = validation_indices(100, 0.2)  # another worker, another seed: the same samples
    torch.manual_seed(123)
    assert torch.equal(again[1], held) and torch.equal(validation_indices(100, 0.2)[1], held)
    with pytest.raises(ValueError, match="leaves no training or no validation"):
        validation_indices(3, 0.01 / 10**6 + 0.999)

    x, y = torch.arange(50.0).reshape(50, 1), torch.arange(50)
    train, val = split_validation(torch.utils.data.TensorDataset(x, y), 0.2)
    assert isinstance(train, torch.utils.data.TensorDataset) and len(val) == 10
    subset_train, subset_val = split_validation(_Listed(50), 0.2)
    assert [subset_val[i] for i in range(10)] == [int(v) for v in val.tensors[1]]
    assert len(subset_train) == 40

    monkeypatch.setenv("DISTSGD_RUNS", "off")
    model = torch.nn.Linear(1, 50)
    _, config, _, got_train, got_test = api_module._prepare(
        model, (x, y), _Untouchable(), TrainConfig(validation=0.2), None, None
    )
    assert config.validation == 0.2
    assert got_test.tensors[1].tolist() == val.tensors[1].tolist()  # held-out train samples
    assert got_train.tensors[1].tolist() == train.tensors[1].tolist()
    with pytest.raises(ValueError, match="validation must be a fraction"):
        TrainConfig(validation=1.0)


class _Listed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _repeat_run(label: str, seed: int, accuracy: float, **fields: object) -> SchemeRun:
    curves = Curves(
        eval_seconds=[1.0, 2.0],
        eval_samples=[100, 200],
        accuracy=[accuracy - 0.1, accuracy],
        test_loss=[1.0, 0.5],
        loss_seconds=[1.0, 2.0],
        loss_samples=[100, 200],
        train_loss=[1.0, 0.6],
        bytes_seconds=[1.0, 2.0],
        bytes_samples=[100, 200],
        bytes_sent=[10**6, 2 * 10**6],
    )
    return SchemeRun(
        scheme=str(fields.pop("scheme", "hogwild")),
        label=label,
        status=str(fields.pop("status", "ok")),
        seed=seed,
        final_accuracy=accuracy,
        final_test_loss=0.5,
        train_seconds=10.0 + seed,
        curves=curves,
        train_config={"lr": 0.15, "momentum": 0.0, "batch_size": 32, "seed": seed},
        **fields,  # type: ignore[arg-type]
    )


def test_reports_show_mean_and_std_the_baseline_and_every_entrys_settings(tmp_path: Path) -> None:
    trials = [
        Trial(setting={"lr": 0.05}, status="ok", accuracy=0.9),
        Trial(setting={"lr": 0.15}, status="ok", accuracy=0.95),
        Trial(setting={"lr": 0.3}, status="diverged", accuracy=0.1),
    ]
    tuned = {"tuned": {"lr": 0.15}, "trials": trials, "workers": 4}
    runs = [
        *[_repeat_run("hogwild", s, a, repeat=s, **tuned) for s, a in enumerate((0.8, 0.9, 0.85))],
        *[
            _repeat_run(
                "downpour(server_lr=2)",
                s,
                0.7,
                scheme="downpour",
                scheme_options={"server_lr": 2.0, "window": 5},  # window 5 is its default
                overrides={"momentum": 0.0, "eval_every": 4, "seed": s},
                workers=4,
            )
            for s in range(3)
        ],
        *[
            _repeat_run(BASELINE_LABEL, s, 0.97, scheme="allreduce", baseline=True, workers=1)
            for s in range(3)
        ],
    ]
    context = dataclasses.replace(
        _context(command="distsgd compare", label="demo", workers=4),
        seed=None,
        repeats=3,
        tune=("lr=0.05,0.15,0.3",),
        validation=0.2,
        target=0.85,
    )
    runs = [with_target(r, 0.85) for r in runs]
    text = markdown(context, runs)
    rows = _rows(text)
    assert list(rows) == ["hogwild", "downpour(server_lr=2)", BASELINE_LABEL]
    header = next(line for line in text.splitlines() if line.startswith("| scheme"))
    assert "final accuracy (mean ± std)" in header and "settings (* = tuned)" in header
    assert "tuned on validation (0.2 of train)" in header
    hogwild = rows["hogwild"]
    assert hogwild[0] == "ok (3 runs)"
    assert hogwild[1] == "0.8500 ± 0.0500"  # mean, sample std of 0.8, 0.9, 0.85
    assert hogwild[3] == "2.0 ± 0.0 (2/3 reached)"  # 0.8 never reached 0.85
    assert hogwild[8] == "lr=0.15*, momentum=0, batch_size=32, 4 workers"
    assert hogwild[9] == "**lr=0.15** (lr=0.05: 0.9000; lr=0.15: 0.9500; lr=0.3: diverged)"
    assert rows["downpour(server_lr=2)"][8] == (
        "lr=0.15, momentum=0, batch_size=32, server_lr=2, 4 workers"  # no default window
    )
    assert rows[BASELINE_LABEL][8].endswith("1 worker")
    assert "sample standard deviation over an entry's 3 runs" in text
    assert "the test set was never read while tuning" in text
    assert "1 worker (allreduce): the same script on one worker" in text
    assert "seeds 0, 1, 2 (--repeats 3: --seed + i)" in text
    assert text.startswith("# distsgd compare: hogwild, downpour(server_lr=2), 1 worker")

    write_json(tmp_path / "c.json", context, runs)
    data = json.loads((tmp_path / "c.json").read_text())
    first = data["entries"][0]
    assert first["tuned"] == {"lr": 0.15} and first["seeds"] == [0, 1, 2]
    assert first["final_accuracy"]["low"] == 0.8 and first["final_accuracy"]["high"] == 0.9
    assert first["final_accuracy"]["n"] == 3
    assert [e["baseline"] for e in data["entries"]] == [False, False, True]
    assert len(data["schemes"]) == 9

    assert legend_label(runs[:3]) == (
        "hogwild: lr=0.15*, momentum=0, batch_size=32, 4 workers, mean of 3 runs"
    )
    assert band([[(1.0, 0.5), (2.0, 0.7)], [(3.0, 0.7), (4.0, 0.9), (5.0, 1.0)]]) == (
        [2.0, 3.0],
        [0.6, 0.8],
        [0.5, 0.7],
        [0.7, 0.9],
    )
    pytest.importorskip("matplotlib")
    write_figure(tmp_path / "c.png", context, runs)
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


def _scored_launch(config: LaunchConfig, console: Console) -> RunOutcome:
    """:func:`_fake_launch` whose accuracy peaks at lr 0.15 and is lower on validation."""
    _fake_launch(config, console)
    lr = float(config.overrides.get("lr", 0.05))
    accuracy = 0.95 - abs(lr - 0.15) - (0.05 if config.overrides.get("validation") else 0.0)
    result = json.loads((config.run_dir / RESULT_FILE).read_text())
    result.update(test_accuracy=accuracy, config={"lr": lr, "seed": config.overrides.get("seed")})
    (config.run_dir / RESULT_FILE).write_text(json.dumps(result))
    (config.run_dir / "launch.json").write_text(json.dumps(dataclasses.asdict(config), default=str))
    return RunOutcome(status=RunStatus.OK, run_dir=config.run_dir)


def test_a_tuned_repeated_comparison_with_a_baseline_without_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(compare_module, "launch", _scored_launch)
    out, said = tmp_path / "out", io.StringIO()
    config = CompareConfig(
        schemes=("hogwild", "allreduce"),
        script=BLOBS,
        out=out,
        overrides={"steps": 12},
        tune=("lr=0.05,0.15,0.3",),
        repeats=2,
        baseline=True,
    )
    assert compare_module.compare(config, Console(said, errors=io.StringIO())) == 0
    assert "1/3 hogwild: chose lr=0.15 (accuracy 0.9000 on validation)" in said.getvalue()
    launched = {
        str(p.parent.relative_to(out)): json.loads(p.read_text()) for p in out.rglob("launch.json")
    }
    tuning = [k for k in launched if k.startswith("tune/")]
    assert len(tuning) == 9 and "tune/hogwild/lr=0.3" in tuning
    assert all(launched[k]["overrides"]["validation"] == 0.2 for k in tuning)
    finals = sorted(k for k in launched if k.startswith("runs/"))
    assert finals == [
        "runs/allreduce/seed0",
        "runs/allreduce/seed1",
        "runs/baseline-1-worker/seed0",
        "runs/baseline-1-worker/seed1",
        "runs/hogwild/seed0",
        "runs/hogwild/seed1",
    ]
    for key in finals:  # the whole training set and the test set, the chosen lr, seed + i
        overrides = launched[key]["overrides"]
        assert "validation" not in overrides and overrides["lr"] == 0.15
        assert overrides["seed"] == int(key[-1])
    assert launched["runs/baseline-1-worker/seed0"]["size"]["workers"] == 1
    assert launched["runs/baseline-1-worker/seed0"]["overrides"]["steps"] == 24
    rows = _rows((out / "compare.md").read_text())
    assert rows["hogwild"][:2] == ["ok (2 runs)", "0.9500 ± 0.0000"]
    assert rows["hogwild"][9] == "**lr=0.15** (lr=0.05: 0.8000; lr=0.15: 0.9000; lr=0.3: 0.7500)"
    assert BASELINE_LABEL in rows
