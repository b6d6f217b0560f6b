"""Keras 3 models (PyTorch backend) under distsgd: the training flag, which parameters are
exchanged and under which names, the evaluation copy's BatchNorm statistics, the workers'
environment; and the Keras CNN of tests/scripts/keras_cnn.py trained by ``distsgd run``."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import loadclock
import numpy as np
import pytest
import torch
from conftest import SCRIPTS, final_accuracy, metrics, run_distsgd
from torch import nn

from distsgd.launcher.keras_env import keras_environment
from distsgd.runtime.modules import (
    as_torch_module,
    exchanged_parameters,
    is_keras_model,
    load_eval_state,
)

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported
os.environ.setdefault("KERAS_TORCH_DEVICE", "cpu")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("KERAS_BACKEND is not torch", allow_module_level=True)

from distsgd.runtime.keras_models import KerasModule  # noqa: E402  (after the skip)

pytestmark = pytest.mark.filterwarnings(  # Keras's own variables, made from numpy
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
SCRIPT = SCRIPTS / "keras_cnn.py"
EXPECTED = [
    "layers.1.kernel",
    "layers.2.gamma",
    "layers.2.beta",
    "layers.2.moving_mean",
    "layers.2.moving_variance",
    "layers.4.kernel",
    "layers.5.gamma",
    "layers.5.beta",
    "layers.5.moving_mean",
    "layers.5.moving_variance",
    "layers.9.seed_generator_state",
    "layers.10.kernel",
    "layers.10.bias",
    "layers.11.kernel",
    "layers.11.bias",
]
"""keras_cnn.build_model()'s parameters as distsgd names them (layer 0 the Input)."""
NOT_EXCHANGED = {n for n in EXPECTED if "moving" in n or "seed" in n}


def build() -> KerasModule:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from keras_cnn import build_model
    finally:
        sys.path.remove(str(SCRIPTS))
    module = as_torch_module(build_model())
    assert isinstance(module, KerasModule)
    return module


def images(n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 8, 8, 1, generator=torch.Generator().manual_seed(seed))


def bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "moving" in n}


# --------------------------------------------------------------------------- the training flag


def test_torch_train_mode_alone_leaves_keras_in_inference() -> None:
    """The pitfall: Keras ignores torch's module.training (Dropout off, BatchNorm frozen)."""
    raw = build().keras_model
    raw.train()
    before = [v.value.detach().clone() for v in raw.non_trainable_variables]
    x = images()
    assert torch.equal(raw(x), raw(x))  # Dropout inactive
    after = [v.value for v in raw.non_trainable_variables]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_train_mode_runs_dropout_and_updates_batchnorm() -> None:
    module = build()
    module.train()
    x = images()
    before = bn_stats(module)
    first, second = module(x), module(x)
    assert not torch.allclose(first, second)  # a new Dropout mask per call
    after = bn_stats(module)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    # the same as Keras's own training call
    assert module.keras_model(x, training=True).shape == first.shape


def test_eval_mode_is_inference() -> None:
    module = build()
    module.train()
    module(images(seed=1))  # move the statistics off their initial values
    module.eval()
    x = images()
    before = bn_stats(module)
    out = module(x)
    assert torch.equal(out, module(x))  # no Dropout
    assert torch.equal(out, module.keras_model(x, training=False))  # the moving statistics
    assert all(torch.equal(before[n], p) for n, p in bn_stats(module).items())


def test_distsgd_evaluate_runs_inference_and_restores_train_mode() -> None:
    from distsgd.runtime.evaluate import evaluate

    module = build()
    module.train()
    data = torch.utils.data.TensorDataset(images(32), torch.randint(0, 10, (32,)))
    scores = [
        evaluate(
            module,
            data,
            nn.functional.cross_entropy,
            batch_size=8,
            device=torch.device("cpu"),
        )
        for _ in range(2)
    ]
    assert scores[0] == scores[1]  # inference: deterministic, statistics untouched
    assert module.training


# --------------------------------------------------------------------------- parameters, names


def test_names_by_position_and_only_trainable_floats_exchanged() -> None:
    module = build()
    assert [n for n, _ in module.named_parameters()] == EXPECTED
    assert list(module.state_dict()) == EXPECTED  # each once, no Keras paths
    exchanged = exchanged_parameters(module)
    assert list(exchanged) == [n for n in EXPECTED if n not in NOT_EXCHANGED]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in exchanged.values())
    params = dict(module.named_parameters())
    assert params["layers.9.seed_generator_state"].dtype == torch.int32


def test_parameters_are_the_keras_variables() -> None:
    """Training the module trains the user's Keras model in place (the same tensors)."""
    module = build()
    ids = {id(v.value) for v in module.keras_model.variables}
    assert {id(p) for p in module.parameters()} == ids
    kernel = module.keras_model.layers[-1].kernel
    with torch.no_grad():
        dict(module.named_parameters())["layers.11.kernel"].add_(1.0)
    assert torch.equal(kernel.value, dict(module.named_parameters())["layers.11.kernel"])


def test_names_do_not_depend_on_what_the_process_built_before() -> None:
    first, second = build(), build()  # Keras numbers the second's layers: conv2d_2, ...
    assert first.keras_model.layers[0].kernel.path != second.keras_model.layers[0].kernel.path
    names = [n for n, _ in second.named_parameters()]
    assert names == [n for n, _ in first.named_parameters()] == EXPECTED
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from keras_cnn import build_model;"
        "from distsgd.runtime.modules import as_torch_module;"
        "print(' '.join(n for n, _ in as_torch_module(build_model()).named_parameters()))"
    )
    env = {**os.environ, "KERAS_BACKEND": "torch", "KERAS_TORCH_DEVICE": "cpu"}
    done = loadclock.run(
        [sys.executable, "-c", code, str(SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == names


def test_auto_named_and_odd_variable_names_get_positions() -> None:
    class Odd(keras.layers.Layer):
        def build(self, input_shape: tuple[int, ...]) -> None:
            self.a = self.add_weight(shape=(2,))  # Keras names it variable, variable_1, ...
            self.b = self.add_weight(shape=(2,), name="w-x")
            self.c = self.add_weight(shape=(2,), name="scale")
            self.d = self.add_weight(shape=(2,), name="scale")

        def call(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.a * self.b * self.c * self.d

    names = []
    for _ in range(2):
        model = keras.Sequential([keras.Input((2,)), Odd()])
        names.append([n for n, _ in as_torch_module(model).named_parameters()])
    assert names[0] == names[1]
    assert names[0] == ["layers.1.var0", "layers.1.var1", "layers.1.scale", "layers.1.var3"]


def test_final_model_loads_into_a_fresh_keras_model() -> None:
    """final_model.pt (the module's state_dict) goes back into a Keras model built anew, as
    docs/keras.md shows, BatchNorm statistics included."""
    trained = build()
    trained.train()
    trained(images(seed=3) * 2)
    state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    fresh = build().keras_model
    KerasModule(fresh).load_state_dict(state)
    trained.eval()
    x = images()
    assert torch.equal(fresh(x, training=False), trained(x))


def test_deepcopy_is_independent_with_the_same_names() -> None:
    module = build()
    module.eval()
    clone = copy.deepcopy(module)
    assert isinstance(clone, KerasModule) and not clone.training
    assert [n for n, _ in clone.named_parameters()] == EXPECTED
    x = images()
    assert torch.equal(clone(x), module(x))
    with torch.no_grad():
        for p in exchanged_parameters(clone).values():
            p.add_(0.5)
    assert not torch.equal(clone(x), module(x))
    assert {id(p) for p in clone.parameters()} == {id(v.value) for v in clone.keras_model.variables}


def test_eval_copy_gets_the_servers_weights_and_the_replicas_statistics() -> None:
    """The chief evaluates the servers' weights loaded into a copy made before training: its
    BatchNorm statistics must be the trained ones of the replica, not the copy's initial."""
    replica = build()
    eval_copy = copy.deepcopy(replica)
    replica.train()
    for seed in range(3):
        replica(images(seed=seed) * 3 + 1)  # trained statistics, far from (0, 1)
    server = {n: p.detach().numpy() + 0.25 for n, p in exchanged_parameters(replica).items()}
    load_eval_state(eval_copy, replica, server)
    got = dict(eval_copy.named_parameters())
    for name, value in bn_stats(replica).items():
        assert torch.equal(got[name], value)
        initial = 0.0 if name.endswith("mean") else 1.0
        assert not torch.allclose(value, torch.full_like(value, initial))
    for name, value in server.items():
        assert np.array_equal(got[name].detach().numpy(), value)


def test_torch_models_keep_their_parameters() -> None:
    """A torch model is not wrapped; all its parameters are exchanged, as before, unless
    frozen; buffers never are."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    assert as_torch_module(model) is model and not is_keras_model(model)
    exchanged = exchanged_parameters(model)
    assert list(exchanged.items()) == list(model.named_parameters())
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in exchanged_parameters(model)
    assert len(exchanged_parameters(model)) == len(exchanged) - 1


def test_own_loop_worker_runs_keras_through_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """distsgd.Worker: worker.model is the wrapper (Dropout on in the loop), and an optimizer
    over all of the Keras model's parameters (non-trainable ones too) is taken."""
    import distsgd

    monkeypatch.delenv("DISTSGD_TASK", raising=False)
    module = build()
    model = module.keras_model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = images(64), torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(0))
    before = bn_stats(module)
    worker = distsgd.Worker(
        model,
        train_data=(x, y),
        test_data=(x, y),
        loss_fn=nn.functional.cross_entropy,
        config=distsgd.TrainConfig(batch_size=16, steps=4),
        optimizer=optimizer,
    )
    assert isinstance(worker.model, KerasModule)
    for inputs, target in worker.batches():
        with worker.step() as step:
            first = worker.model(inputs)
            assert not torch.equal(first, worker.model(inputs))  # training: Dropout on
            loss = nn.functional.cross_entropy(first, target)
            loss.backward()
            step.loss = loss
    result = worker.finish()
    assert result.local_steps == 4 and result.test_accuracy is not None
    assert all(not torch.equal(before[n], p) for n, p in bn_stats(module).items())


def test_unbuilt_keras_model_is_refused_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import distsgd

    monkeypatch.delenv("DISTSGD_TASK", raising=False)
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"not built.*keras\.Input"):
        distsgd.train(
            model=model,
            loss_fn=nn.functional.cross_entropy,
            train_data=(torch.randn(8, 3), torch.zeros(8, dtype=torch.long)),
        )


def test_keras_on_another_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match="KERAS_BACKEND=torch"):
        as_torch_module(build().keras_model)


def test_a_model_on_another_device_than_keras_is_refused() -> None:
    module = build()
    module.to("cpu")  # Keras's own device: fine
    with pytest.raises(ValueError, match="KERAS_TORCH_DEVICE"):
        module.to("meta")


def test_distsgd_does_not_import_keras_for_torch_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """With keras unimportable (None in sys.modules: ``import keras`` raises), a torch model
    trains: nothing on its way imports keras, or asks it."""
    import distsgd

    monkeypatch.setitem(sys.modules, "keras", None)
    monkeypatch.delenv("DISTSGD_TASK", raising=False)
    with pytest.raises(ImportError):
        import keras as _  # noqa: F401  (the block works)
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    result = distsgd.train(
        model=model,
        loss_fn=nn.functional.cross_entropy,
        train_data=(x, y),
        test_data=(x, y),
        config=distsgd.TrainConfig(batch_size=16, steps=3),
    )
    assert result.test_accuracy is not None


# --------------------------------------------------------------------------- worker environment


@pytest.mark.parametrize(
    ("device", "gpu", "want"),
    [
        ("auto", True, "cuda"),
        ("cuda", True, "cuda"),
        ("auto", False, "cpu"),
        ("cpu", False, "cpu"),
        ("cuda:1", False, "cuda:1"),
        ("", False, None),  # the model stays where the script built it: Keras's choice
        ("auto", None, None),  # under Ray: Keras picks the GPU Ray gave, as auto does
    ],
)
def test_worker_environment(device: str, gpu: bool | None, want: str | None) -> None:
    env = keras_environment(device, gpu=gpu, environ={})
    assert env.get("KERAS_TORCH_DEVICE") == want
    assert env["KERAS_BACKEND"] == "torch"


def test_worker_environment_keeps_the_users_settings() -> None:
    mine = {"KERAS_BACKEND": "jax", "KERAS_TORCH_DEVICE": "cuda:0"}
    assert keras_environment("cpu", gpu=False, environ=mine) == {}


# --------------------------------------------------------------------------- distsgd run


@pytest.mark.slow
@pytest.mark.xdist_group("demo-runs")
@pytest.mark.parametrize("scheme", ["hogwild", "allreduce"])
def test_keras_cnn_trains_under_distsgd_run(scheme: str, tmp_path: Path) -> None:
    """A Keras model under a parameter-server scheme and under all-reduce (what a Keras model
    meets differs by that alone: its variables as the servers' pieces, or DDP's buckets; a
    third scheme cost 16 CPU-seconds of the suite's 12 minutes and added no path). Two workers,
    5 epochs: the same 110 local steps as 4 workers for 10 epochs, at half the CPU (each worker
    imports Keras); measured 3 times on a loaded machine: hogwild 0.9833, 0.9778, 0.9806,
    allreduce 0.9722 each time; the evaluation at step 100 0.9722 or more)."""
    run_dir = tmp_path / "run"
    ps = "0" if scheme == "allreduce" else "1"
    args = ["run", "--workers", "2", "--ps", ps, "--scheme", scheme, "--quiet"]
    args += ["--eval-every", "50"]  # and at the end (local step 110)
    done = run_distsgd([*args, "--run-dir", str(run_dir), str(SCRIPT), "--epochs", "5"])
    accuracy = final_accuracy(done)
    assert accuracy >= 0.95, done.stdout[-2000:]
    # The evaluation at step 100 (under hogwild and sync the servers' weights in the chief's
    # copy made before training): with the initial BatchNorm statistics (0, 1) instead of the
    # replica's the trained model scores about 0.88.
    evals = {m["local_step"]: m["accuracy"] for m in metrics(run_dir) if "accuracy" in m}
    assert evals[100] >= 0.94, evals
    state = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert list(state) == EXPECTED
    log = (run_dir / "logs" / "worker0.log").read_text()
    printed = json.loads(next(ln for ln in log.splitlines() if ln.startswith("bn: "))[4:])
    for i, stats in zip((2, 5), printed.values(), strict=True):
        mean, var = state[f"layers.{i}.moving_mean"], state[f"layers.{i}.moving_variance"]
        # trained: far from the initial 0 and 1, plausible (finite, variance > 0) ...
        assert mean.abs().max() > 0.05 and (var - 1).abs().max() > 0.05
        assert torch.isfinite(mean).all() and (var > 0).all() and torch.isfinite(var).all()
        # ... and those of the user's Keras model after distsgd.train (the chief's replica,
        # which it evaluated last)
        assert torch.allclose(mean, torch.tensor(stats["moving_mean"]))
        assert torch.allclose(var, torch.tensor(stats["moving_variance"]))
