"""Planning above the worker: the cost model (``cost``), the schemes' traffic (``traffic``), the
simulator (``simulate``).

Torch-free: it predicts a run from measured or assumed parts before any worker starts;
``distsgd plan`` (``cli/plan.py``) measures the parts and prints the predictions, or with
``--simulate`` the simulated runs.
"""
