"""Control plane: what a run is, where its state lives, and what to do when a task dies.

Torch-free data and pure decisions, planned above the worker and carried out below it (the
worker runtime, the launcher): the training config (:mod:`~distsgd.control.config`), the fault
plan (:mod:`~distsgd.control.faults`), a task's environment (:mod:`~distsgd.control.task`), the
run folder's layout (:mod:`~distsgd.control.folder`), the records a run writes (metrics, event
files, phase timings, progress lines) and the verdicts it ends with (setup errors, divergence).

This package imports no torch: the launcher, ``compare`` and the parameter-server process use it
without PyTorch installed. The layer test checks that it imports nothing above ``ps``.
"""
