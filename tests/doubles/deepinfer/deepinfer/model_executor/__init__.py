"""TEST DOUBLE of ``deepinfer.model_executor`` (only ``parallel_utils.parallel_state``)."""
