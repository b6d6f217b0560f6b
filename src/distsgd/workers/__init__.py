"""The schemes' worker halves (PyTorch): ``workers/<name>.py`` holds the hooks of the scheme
``distsgd.schemes.<name>``, whose spec names it by import path. Only a process that trains
imports this package."""
