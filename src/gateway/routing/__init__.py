"""Routing pieces behind ``gateway.router``: policies, targets, circuit breakers, the routed event stream,
shadow traffic and their metrics. One concept per module."""
