"""Emulators for distsgd: what tries a cluster run on one machine, and what a real cluster never
uses. Emulated hosts (:mod:`distsgd_emulate.netns`: network namespaces with shaped links and
private disks; ``distsgd run --hosts N`` and ``distsgd-emulate hosts``), their network faults
and link samples, the link probe of ``distsgd plan --link``, and the Kubernetes JobSet emulator
(``distsgd-emulate k8s``). It imports ``distsgd``; ``distsgd`` reaches it only through
:mod:`distsgd.launcher.emulated`.
"""
