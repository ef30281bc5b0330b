"""Routing: which target serves a request. ``model_router.ModelRouter`` maps a public model name to a target; the
other modules are its pieces: policies, targets, circuit breakers, the routed event stream, shadow traffic and their
metrics. One concept per module."""
