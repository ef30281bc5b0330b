"""deepinfer-gateway: the OpenAI-compatible HTTP front end."""

__version__ = "0.1.0"
