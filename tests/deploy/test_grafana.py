"""The Grafana dashboard (``deploy/grafana/deepinfer-gateway.json``) asks only for what the gateway exports.

Every PromQL expression of the dashboard (panel targets and variable queries) is parsed with a real PromQL parser
(``promql-parser``: the Rust port of Prometheus' own grammar, with its function signatures and argument types)
after Grafana's variables are put in, and every series it selects, every label it matches or groups by and every
value it matches exactly is checked against a ``/metrics`` scrape of a real gateway: the reference engine behind
admission control and a shadow, two data-parallel ranks, an LMDeploy backend on LMDeploy's real api_server (the
test harness, with one engine failure injected), per-key budgets. The test knows no metric name of its own:
after a metric is renamed, it names the panels that still ask for the old one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import promql_parser as promql
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig

from ..backends.lmdeploy.harness.server import API_KEY, MODEL_NAME, make_node
from ..backends.lmdeploy.harness.venv import harness_python
from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "deepinfer-gateway.json"
OPEN_KEY, LIMITED_KEY = "sk-dashboard-open-1", "sk-dashboard-limited-2"
ADMIN_KEY = "sk-dashboard-admin-3"
GRAFANA_DURATIONS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
SCRAPE_LABELS = {"job", "instance"}  # added by Prometheus to every series it scrapes
SERIES_OF_TYPE = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


@dataclass
class Exported:
    """What one scrape of ``/metrics`` offers: series names, and for those with samples their labels and values."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)

    @classmethod
    def scrape(cls, text: str) -> Exported:
        exported = cls()
        for family in text_string_to_metric_families(text):
            for suffix in SERIES_OF_TYPE.get(family.type, ("",)):
                exported.names.add(family.name + suffix)
            for sample in family.samples:
                exported.names.add(sample.name)
                values = exported.labels.setdefault(sample.name, {})
                for name, value in sample.labels.items():
                    values.setdefault(name, set()).add(value)
        return exported


if harness_python() is None:  # the first test to start a harness node builds its virtualenv (minutes)
    pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """A scrape of a gateway that has served a bit of everything the dashboard shows."""
    node = make_node(
        tmp_path_factory.mktemp("lmdeploy"), "dashboard", "--model-name", MODEL_NAME, "--api-keys", API_KEY
    )
    node.start()
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [
                    {"key": OPEN_KEY, "name": "open"},
                    {"key": LIMITED_KEY, "name": "limited", "requests_per_minute": 1},
                ],
                "admin_api_key": ADMIN_KEY,
            }
        },
        backends=[
            {"name": "reference", "kind": "reference", "max_in_flight": 4},
            {"name": "spare", "kind": "reference"},
            {"name": "ranked", "kind": "reference", "data_parallel_size": 2},
            {"name": "lm", "kind": "lmdeploy", "urls": [node.url], "api_key": API_KEY, "max_model_len": 2048},
        ],
        models=[
            {"name": "m", "backends": ["reference"], "shadow": {"backend": "spare", "fraction": 1.0}},
            {"name": "ranked", "backends": ["ranked"]},
            {"name": "lm", "backends": ["lm"]},
        ],
    )
    running: RunningGateway = start_gateway(config)
    try:
        assert wait_until(lambda: all(b.readiness()[0] for b in running.state.backends.values()), 120)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        failing = {"messages": [{"role": "user", "content": "hi [[stub fail=INTERNAL_ENGINE_ERROR after=0]]"}]}
        for body, status in (
            ({"model": "m", **chat}, 200),
            ({"model": "ranked", **chat}, 200),
            ({"model": "lm", **chat}, 200),
            ({"model": "lm", **failing}, 502),
        ):
            response = httpx.post(
                f"{running.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {OPEN_KEY}"},
                timeout=60,
            )
            assert response.status_code == status, response.text
        statuses = [
            httpx.post(
                f"{running.base_url}/v1/chat/completions",
                json={"model": "m", **chat},
                headers={"Authorization": f"Bearer {LIMITED_KEY}"},
                timeout=60,
            ).status_code
            for _ in range(2)
        ]
        assert statuses == [200, 429]
        assert wait_until(lambda: all(s.active == 0 for s in running.state.router.shadows()))
        scraped = httpx.get(f"{running.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        yield Exported.scrape(scraped.text)
    finally:
        stop_gateway(running)
        node.stop()


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def expressions(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable (``label_values(metric, label)``)."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert found, f"variable {variable['name']}: {query!r} is not label_values(metric, label)"
            yield f"variable {variable['name']}", f"group by ({found[2]}) ({found[1]})"


def with_variables(expr: str, variables: set[str]) -> str:
    """``expr`` with Grafana's variables put in: interval variables as durations, the dashboard's own (always
    inside a label matcher's regex) as ``.*``. Raises ``ValueError`` for a variable the dashboard does not define."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name in GRAFANA_DURATIONS:
            return GRAFANA_DURATIONS[name]
        if name not in variables:
            raise ValueError(f"${name} is not a variable of the dashboard")
        return ".*"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


@dataclass
class Selection:
    """The series an expression selects, with the labels it matches, and the labels its aggregations group by."""

    selectors: list[promql.VectorSelector] = field(default_factory=list)
    grouped: list[tuple[list[str], list[promql.VectorSelector]]] = field(default_factory=list)


def select(node: Any, found: Selection) -> list[promql.VectorSelector]:
    """Walks the parsed expression; returns the selectors under ``node``. Fails on a node it does not know, so a
    construct this test does not check cannot slip through."""
    if isinstance(node, promql.VectorSelector):
        found.selectors.append(node)
        return [node]
    if isinstance(node, promql.MatrixSelector):
        return select(node.vector_selector, found)
    if isinstance(node, promql.AggregateExpr):
        under = select(node.expr, found)
        if node.param is not None:
            select(node.param, found)
        if node.modifier is not None and node.modifier.type == promql.AggModifierType.By:
            found.grouped.append((list(node.modifier.labels), under))
        return under
    if isinstance(node, promql.BinaryExpr):
        return select(node.lhs, found) + select(node.rhs, found)
    if isinstance(node, promql.Call):
        return [s for arg in node.args for s in select(arg, found)]
    if isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
        return select(node.expr, found)
    if isinstance(node, promql.NumberLiteral | promql.StringLiteral):
        return []
    raise AssertionError(f"a PromQL node this test does not check: {type(node).__name__}: {node}")


def metric_name(selector: promql.VectorSelector) -> str:
    if selector.name:
        return selector.name
    named = [m.value for m in selector.matchers.matchers if m.name == "__name__" and m.op == promql.MatchOp.Equal]
    assert named, f"{selector}: the dashboard selects series by metric name"
    return named[0]


def problems(where: str, expr: str, exported: Exported, variables: set[str]) -> list[str]:
    try:
        parsed = promql.parse(with_variables(expr, variables))
    except ValueError as exc:  # the parser's errors, and an unknown variable
        return [f"{where}: not valid PromQL ({exc}): {expr}"]
    found = Selection()
    select(parsed, found)
    out = []
    for selector in found.selectors:
        name = metric_name(selector)
        if name not in exported.names:
            out.append(f"{where}: {name} is not exported")
            continue
        labels = exported.labels.get(name)
        if labels is None:
            continue  # exported but without samples in this scrape: its labels cannot be checked
        for matcher in selector.matchers.matchers:
            if matcher.name == "__name__" or matcher.name in SCRAPE_LABELS:
                continue
            if matcher.name not in labels:
                out.append(f"{where}: {name} has no label {matcher.name!r}")
            elif matcher.op == promql.MatchOp.Equal and matcher.value not in labels[matcher.name]:
                out.append(f"{where}: {name}{{{matcher.name}={matcher.value!r}}} was never seen")
    for grouping, under in found.grouped:
        known = set(SCRAPE_LABELS)
        checked = False
        for selector in under:
            labels = exported.labels.get(metric_name(selector))
            if labels is not None:
                known |= set(labels)
                checked = True
        for label in grouping:
            if checked and label not in known:
                out.append(f"{where}: grouped by {label!r}, which none of {[str(s) for s in under]} has")
    return out


def test_every_dashboard_query_selects_metrics_and_labels_the_gateway_exports(exported: Exported) -> None:
    board = dashboard()
    variables = {v["name"] for v in board["templating"]["list"]}
    queries = list(expressions(board))
    assert len(queries) > 30
    found = [p for where, expr in queries for p in problems(where, expr, exported, variables)]
    assert found == []


def test_the_check_catches_a_metric_or_label_that_does_not_exist(exported: Exported) -> None:
    """The check itself, on expressions with one mistake each."""
    variables = {"model", "backend"}
    good = 'sum by (backend) (rate(gateway_requests_total{model=~"$model"}[$__rate_interval]))'
    assert problems("good", good, exported, variables) == []
    for bad in (
        good.replace("gateway_requests_total", "gateway_request_total"),  # a typo in the name
        good.replace("gateway_requests_total", "gateway_requests"),  # a counter without _total
        good.replace("by (backend)", "by (backends)"),
        good.replace('model=~"$model"', 'modle=~"$model"'),
        'sum(rate(gateway_request_errors_total{code="rate_limit_exceded"}[5m]))',
        good.replace("rate(", "rat("),
        good.replace("[$__rate_interval]", ""),  # rate of an instant vector
        good.replace("$model", "$modle"),
    ):
        assert problems("bad", bad, exported, variables), bad


def test_the_dashboard_is_importable_as_is() -> None:
    """What Grafana's import needs, with no edits: every query on the data source variable, unique panel ids,
    panels on the 24-column grid without overlaps."""
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    (source,) = (v for v in board["templating"]["list"] if v["type"] == "datasource")
    assert source["query"] == "prometheus" and source["name"] == "datasource"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels(board):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        taken = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not taken & cells, f"{panel['title']} overlaps another panel"
        cells |= taken
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["refId"], panel["title"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
