"""Generic driver for in-process engines that speak DeepInfer's ``LLMEngine`` API."""
