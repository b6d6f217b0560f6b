"""distsgd.Worker: a training loop of the user's own, run as a distsgd worker.

In-process tests run it alone (``python script.py``: one worker, allreduce); the real runs
start ``distsgd run`` on tests/scripts/own_loop.py, the README's and the guide's example.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import final_accuracy, run_distsgd, run_scheme
from torch import nn

import distsgd

SCRIPT = Path(__file__).parent / "scripts" / "own_loop.py"


def _data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


CONFIG = distsgd.TrainConfig(batch_size=16, epochs=3, lr=0.2, log_every=1)


def _own_loop(model: nn.Module, **kwargs: object) -> distsgd.TrainResult:
    with distsgd.Worker(model, **kwargs) as worker:  # type: ignore[arg-type]
        for inputs, target in worker.batches():
            with worker.step() as step:
                loss = F.cross_entropy(worker.model(inputs), target)
                loss.backward()
                step.loss = loss
    assert worker.result is not None
    return worker.result


def test_a_loop_of_ones_own_trains_exactly_as_train_does() -> None:
    """The same model, data and config through distsgd.train and through the Worker loop end
    with the same parameters: both are the one session, driven alike."""
    data, test = _data(), _data(64, seed=1)
    a, b = _model(), _model()
    by_train = distsgd.train(
        model=a, loss_fn=F.cross_entropy, train_data=data, test_data=test, config=CONFIG
    )
    by_loop = _own_loop(b, train_data=data, test_data=test, loss_fn=F.cross_entropy, config=CONFIG)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert by_loop.local_steps == by_train.local_steps == 3 * (256 // 16)
    assert by_loop.test_accuracy == by_train.test_accuracy
    assert by_loop.test_accuracy is not None and by_loop.test_accuracy > 0.8


def test_a_loop_over_its_own_data_runs_the_configured_steps() -> None:
    x, y = _data()
    model = _model()
    worker = distsgd.Worker(model, config=CONFIG.replace(steps=7))
    assert worker.task.rank == 0 and worker.task.num_workers == 1 and worker.start_step == 0
    taken = 0
    while not worker.done:
        with worker.step() as step:
            loss = F.cross_entropy(worker.model(x[:16]), y[:16])
            loss.backward()
            step.loss = loss
            step.samples = 16
        taken += 1
    result = worker.finish()
    assert taken == 7 == result.local_steps and result.samples == 7 * 16
    assert worker.finish() is result  # a second finish changes nothing


def test_without_a_length_a_schedule_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match="need the run's length"):
        distsgd.Worker(_model(), config=CONFIG.replace(lr_schedule="cosine"))


def test_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match="pass both or neither"):
        distsgd.Worker(_model(), test_data=_data())
    worker = distsgd.Worker(_model(), config=CONFIG.replace(steps=2))
    with pytest.raises(ValueError, match="pass train_data="):
        next(iter(worker.batches()))
    with pytest.raises(ValueError, match="not a number"):
        worker.log(note="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a name is letters"):
        worker.log(**{"two words": 1.0})
    with worker.step():
        with pytest.raises(RuntimeError, match="step\\(\\) inside a step"), worker.step():
            pass
        F.cross_entropy(worker.model(_data()[0][:4]), _data()[1][:4]).backward()
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        distsgd.Worker(_model(), optimizer=torch.optim.SGD(_model().parameters(), lr=0.1))
    worker.finish()


def test_an_exception_inside_a_step_leaves_it_untaken() -> None:
    worker = distsgd.Worker(_model(), config=CONFIG.replace(steps=3))
    with pytest.raises(KeyError), worker.step():
        raise KeyError("the user's own bug")
    assert worker.local_step == 0
    x, y = _data()
    while not worker.done:
        with worker.step():
            F.cross_entropy(worker.model(x[:16]), y[:16]).backward()
    assert worker.finish().local_steps == 3


def test_an_optimizer_of_ones_own_is_the_one_the_scheme_steps() -> None:
    data = _data()
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    _own_loop(model, train_data=data, config=CONFIG, optimizer=adam)
    assert adam.state and all(s["step"] == 3 * (256 // 16) for s in adam.state.values())
    sgd_model = _model()
    _own_loop(sgd_model, train_data=data, config=CONFIG)
    assert not torch.equal(next(model.parameters()), next(sgd_model.parameters()))


class _Recorder(distsgd.Callback):
    every_steps = 5

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.scores: list[dict[str, float]] = []

    def on_step(self, info: distsgd.StepInfo) -> None:
        assert info.is_chief and math.isfinite(info.loss) and info.samples == info.local_step * 16
        self.steps.append(info.local_step)

    def on_evaluate(self, info: distsgd.StepInfo, scores: object) -> None:
        self.scores.append(dict(scores))  # type: ignore[call-overload]


def test_train_calls_callbacks_and_evaluates_user_metrics(tmp_path: Path) -> None:
    recorder = _Recorder()
    every: list[int] = []

    def error_rate(output: torch.Tensor, target: torch.Tensor) -> float:
        return float((output.argmax(1) != target).float().mean())

    result = distsgd.train(
        model=_model(),
        loss_fn=F.cross_entropy,
        train_data=_data(),
        test_data=_data(64, seed=1),
        config=CONFIG.replace(eval_every=16),
        callbacks=[recorder, distsgd.Every(16, lambda info: every.append(info.local_step))],
        metrics={"error_rate": error_rate},
    )
    assert recorder.steps == list(range(5, 48 + 1, 5))
    assert every == [16, 32, 48]
    assert len(recorder.scores) == 4  # after steps 16, 32, 48, and the final evaluation
    assert result.test_accuracy is not None
    assert result.metrics["error_rate"] == pytest.approx(1 - result.test_accuracy)
    assert recorder.scores[-1]["error_rate"] == result.metrics["error_rate"]
    with pytest.raises(ValueError, match="accuracy is distsgd's own"):
        distsgd.train(
            model=_model(),
            loss_fn=F.cross_entropy,
            train_data=_data(),
            metrics={"accuracy": error_rate},
        )


# --------------------------------------------------------------------------- real runs

# Every scheme trains the example loop on 4 workers, with a worker and a server killed mid-run:
# tests/test_fault_tolerance.py (its disturbed runs are tests/scripts/own_loop.py).


@pytest.mark.slow
def test_a_loop_over_its_own_data_loader_and_optimizer_trains_with_4_workers(
    tmp_path: Path,
) -> None:
    done = run_scheme("easgd", tmp_path / "run", SCRIPT, "own-data", "adam", workers=4)
    accuracy = final_accuracy(done)
    assert accuracy >= 0.95, accuracy


def test_an_optimizer_under_a_scheme_whose_servers_update_is_refused(tmp_path: Path) -> None:
    done = run_scheme("hogwild", tmp_path / "run", SCRIPT, "own-data", "adam")
    assert done.returncode != 0
    assert "optimizer= under hogwild: its parameter servers apply every update" in done.stderr


def test_forward_past_the_ddp_wrapper_is_named(tmp_path: Path) -> None:
    script = tmp_path / "raw.py"
    script.write_text(
        SCRIPT.read_text().replace(
            "F.cross_entropy(worker.model(inputs)", "F.cross_entropy(model(inputs)"
        )
    )
    done = run_distsgd(
        [
            "run",
            "--workers",
            "2",
            "--scheme",
            "allreduce",
            "--quiet",
            "--steps",
            "3",
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
        ]
    )
    assert done.returncode != 0
    assert "forward must run through worker.model" in done.stderr


def test_workers_left_open_are_counted_until_finished_or_closed() -> None:
    from distsgd import api

    before = api.unfinished
    first = distsgd.Worker(_model(), config=CONFIG.replace(steps=1))
    second = distsgd.Worker(_model(), config=CONFIG.replace(steps=1))
    assert api.unfinished == before + 2
    second.close()
    second.close()  # counted once
    assert api.unfinished == before + 1
    x, y = _data()
    with first.step():
        F.cross_entropy(first.model(x[:16]), y[:16]).backward()
    first.finish()
    first.finish()
    assert api.unfinished == before


def test_a_script_that_never_finishes_its_worker_is_told_so(tmp_path: Path) -> None:
    script = tmp_path / "open.py"
    source = SCRIPT.read_text()
    end = source.index("result = worker.finish()")
    script.write_text(source[:end])  # the loop, and nothing after it
    flags = ["--workers", "2", "--steps", "5", "--quiet", "--run-dir", str(tmp_path / "r")]
    done = run_distsgd(["run", *flags, str(script), "own-data"])
    assert done.returncode == 1, done.stderr
    assert "never called worker.finish()" in done.stderr.strip().splitlines()[-1]
    assert "restart" not in done.stdout + done.stderr
