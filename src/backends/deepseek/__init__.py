"""DeepSeek model-family code: the V4.1 prompt format and its output conventions."""
