"""Anthropic's Messages API (``/v1/messages``), translated to and from the gateway's one request and event stream.

``protocol`` validates request bodies, ``translate`` turns them into a chat ``GenerateRequest``, ``output`` writes
the backend's events as Anthropic messages and stream events, ``signatures`` signs and checks thinking blocks, and
``errors`` gives failures Anthropic's shape. The route is ``gateway.endpoints.messages``.
"""
