"""The per-node metric families of an LMDeploy backend (labels: backend, node), read at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import Metric

from backends.lmdeploy.nodes import NodePool


def node_metric_families(backend: str, pool: NodePool, connections_created: int) -> list[Metric]:
    """Health, load, errors, failovers and latencies of every node of ``pool``, and the connections the backend's
    pooled client opened."""
    labels = ["backend", "node"]
    healthy = GaugeMetricFamily(
        "gateway_lmdeploy_node_healthy", "1 while the LMDeploy node passes health checks.", labels=labels
    )
    in_flight = GaugeMetricFamily(
        "gateway_lmdeploy_node_requests_in_flight", "Upstream requests open on the node.", labels=labels
    )
    requests = CounterMetricFamily(
        "gateway_lmdeploy_node_requests", "Upstream requests sent to the node.", labels=labels
    )
    errors = CounterMetricFamily(
        "gateway_lmdeploy_node_errors", "Failed upstream requests by kind.", labels=[*labels, "kind"]
    )
    retries = CounterMetricFamily(
        "gateway_lmdeploy_node_failovers",
        "Requests moved from this node to another before their first byte.",
        labels=labels,
    )
    probes = CounterMetricFamily("gateway_lmdeploy_node_health_probe_failures", "Failed /health probes.", labels=labels)
    first_byte = SummaryMetricFamily(
        "gateway_lmdeploy_node_first_byte_seconds",
        "Time from sending a request to its first stream event.",
        labels=labels,
    )
    duration = SummaryMetricFamily("gateway_lmdeploy_node_request_seconds", "Upstream request duration.", labels=labels)
    behind = GaugeMetricFamily(
        "gateway_lmdeploy_proxy_nodes",
        "Nodes an LMDeploy proxy listed for the model at its last probe, by role (Hybrid, Prefill, Decode).",
        labels=[*labels, "role"],
    )
    connections = CounterMetricFamily(
        "gateway_lmdeploy_connections_created",
        "TCP connections the backend's pooled client opened (keep-alive reuse keeps this flat).",
        labels=["backend"],
    )
    for node in pool.nodes:
        values = [backend, node.url]
        healthy.add_metric(values, 1.0 if node.healthy else 0.0)
        in_flight.add_metric(values, node.in_flight)
        requests.add_metric(values, node.requests)
        retries.add_metric(values, node.retries_away)
        probes.add_metric(values, node.probes_failed)
        for kind, count in node.errors.items():
            errors.add_metric([*values, kind], count)
        first_byte.add_metric(values, count_value=node.first_byte_count, sum_value=node.first_byte_seconds)
        duration.add_metric(values, count_value=node.request_count, sum_value=node.request_seconds)
        if node.proxy_view is not None:
            view = node.proxy_view
            for role, count in (("Hybrid", view.hybrid), ("Prefill", view.prefill), ("Decode", view.decode)):
                behind.add_metric([*values, role], count)
    connections.add_metric([backend], connections_created)
    return [healthy, in_flight, requests, errors, retries, probes, first_byte, duration, behind, connections]
