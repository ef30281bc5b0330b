"""The HTTP endpoints, one module per API group; each turns a body into a request for ``gateway.pipeline``."""
