"""TEST DOUBLE of ``deep_cluster``, the hardware helpers that ship inside the ``deepinfer`` distribution."""
