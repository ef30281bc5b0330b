"""OpenAI wire format: request models (validated once per request) and response/chunk builders (plain dicts)."""
