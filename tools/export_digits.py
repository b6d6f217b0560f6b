"""Regenerate ``src/distsgd/demo/digits.npz`` from scikit-learn's bundled digits.

The data are the UCI "Optical Recognition of Handwritten Digits" test set
(Alpaydin & Kaynak, 1998; CC BY 4.0) as scikit-learn ships them: 1,797 8x8
images with values 0..16. distsgd ships them inside its own package so that
the demo needs neither scikit-learn nor a download. Run with scikit-learn
installed: ``python tools/export_digits.py``.
"""

from __future__ import annotations

import pathlib

import numpy as np
from sklearn.datasets import load_digits

OUT = pathlib.Path(__file__).resolve().parents[1] / "src" / "distsgd" / "demo" / "digits.npz"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.uint8)  # (1797, 8, 8), values 0..16
    labels = digits.target.astype(np.uint8)
    np.savez_compressed(OUT, images=images, labels=labels)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(labels)} images)")


if __name__ == "__main__":
    main()
