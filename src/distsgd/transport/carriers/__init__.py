"""The carriers of a client's tensors, one per way the bytes travel (see "Shared memory",
"Tensor socket" and "Data channel" in ``proto/distsgd.proto``):

- :mod:`.base`: the :class:`~.base.Carrier` interface, a push's :class:`~.base.Payload`, and
  :class:`~.base.CarrierFailed`;
- :mod:`.stream`: the gRPC streams (Pull, Push), always there;
- :mod:`.attached`: what a carrier the server attached has in common (PullShared and
  PushShared, by gRPC or on a data channel);
- :mod:`.segment`: a shared-memory segment; :mod:`.tensor_socket`: a tensor socket;
- :mod:`.attach`: which one a client attaches, and when it gives up on them.
"""
