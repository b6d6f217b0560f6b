"""A Keras 3 CNN (PyTorch backend, BatchNorm and Dropout) on the demo digits, by distsgd.train.

Usage: python keras_cnn.py [--epochs N]; under ``distsgd run`` the chief prints the test
accuracy and, as ``bn: {...}``, the BatchNorm moving statistics of its Keras model after
training (tests/test_keras.py compares them with final_model.pt).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported

import keras
import torch.nn.functional as F

import distsgd
from distsgd.demo.digits import load_digits


def build_model() -> keras.Model:
    """conv 16 + BN -> conv 32 + BN -> max-pool -> dropout -> dense 64 -> dense 10."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, padding="same", use_bias=False),
            layers.BatchNormalization(momentum=0.9),
            layers.ReLU(),
            layers.Conv2D(32, 3, padding="same", use_bias=False),
            layers.BatchNormalization(momentum=0.9),
            layers.ReLU(),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dropout(0.25),
            layers.Dense(64, activation="relu"),
            layers.Dense(10),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=float, default=10)
    args = parser.parse_args()
    config = distsgd.TrainConfig(
        batch_size=32, epochs=args.epochs, lr=0.1, momentum=0.0, lr_schedule="cosine", warmup=0.1
    )
    distsgd.seed_everything(config.seed)
    keras.utils.set_random_seed(config.seed)
    (x, y), (x_test, y_test) = load_digits()
    # Keras convolutions are channels-last: (N, 1, 8, 8) -> (N, 8, 8, 1)
    train = (x.permute(0, 2, 3, 1).contiguous(), y)
    test = (x_test.permute(0, 2, 3, 1).contiguous(), y_test)
    model = build_model()
    result = distsgd.train(
        model=model, loss_fn=F.cross_entropy, train_data=train, test_data=test, config=config
    )
    if distsgd.task().is_chief:
        stats = {
            layer.name: {
                "moving_mean": layer.moving_mean.value.tolist(),  # torch tensors
                "moving_variance": layer.moving_variance.value.tolist(),
            }
            for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
        }
        print("bn: " + json.dumps(stats))
        print(f"test accuracy: {result.test_accuracy:.4f}")


if __name__ == "__main__":
    main()
