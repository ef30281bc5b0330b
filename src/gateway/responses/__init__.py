"""The Responses API (``/v1/responses``): its request protocol, its output, its route and its stored responses."""
