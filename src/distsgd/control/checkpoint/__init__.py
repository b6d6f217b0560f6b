"""A run's checkpoints without torch: their layout, manifests and safety checks
(:mod:`~distsgd.control.checkpoint.store`, :mod:`~distsgd.control.checkpoint.manifests`,
:mod:`~distsgd.control.checkpoint.safety`). The worker state's own codec, which needs torch,
is the runtime's ``checkpoint`` module."""
