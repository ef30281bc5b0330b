"""TEST DOUBLE of ``deepinfer.model_executor.parallel_utils``."""
