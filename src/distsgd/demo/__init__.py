"""The bundled demo: a small CNN on real handwritten digits that ship inside this package."""
