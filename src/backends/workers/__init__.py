"""Data-parallel engine workers: N engine ranks in worker processes behind one dispatcher (docs/data-parallel.md).

``worker`` is the rank process, ``driver`` the dispatcher side (same surface as ``EngineDriver``), ``balancer`` the
choice of rank, ``collective`` the lockstep rules and their CPU imitation, ``backend`` the ``EngineBackend`` over it.
"""
