"""Backends: everything that turns a normalized GenerateRequest into a stream of events.

This package knows nothing of HTTP or OpenAI JSON; the gateway package translates at its edge.
"""
