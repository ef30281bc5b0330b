"""TEST DOUBLE of ``deepinfer.engine``."""
