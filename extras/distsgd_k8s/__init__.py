"""``distsgd k8s render``, out of the library's core: the manifests of a run on Kubernetes
(:mod:`distsgd_k8s.render`: a JobSet, a Secret, a PersistentVolumeClaim, a Kubeflow Trainer
runtime, a Dockerfile) and the command that writes them (:mod:`distsgd_k8s.command`).

What a pod needs at run time stays in the core: its identity from the JobSet's variables
(:mod:`distsgd.cluster.kube`) and the run control (:mod:`distsgd.launcher.k8s_control`). distsgd
reaches this package only through :mod:`distsgd.cli.k8s`, inside a function, when the command
is ``distsgd k8s render``; nothing else loads it (tests/test_import_graph.py).
"""
