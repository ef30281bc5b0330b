"""HTTP routes, one module per API group."""
