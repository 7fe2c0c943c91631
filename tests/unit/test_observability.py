"""The shipped Grafana dashboard, Prometheus alert rules and
docs/observability.md name only series p2p_kv exports, spelt as vLLM's
Prometheus client writes them at /metrics; the rules are well formed and
each has a promtool test. tests/e2e/test_serve_metrics.py checks the same
names against a real engine's /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2p_kv.runtime.metrics import DEFINITIONS, PREFIX

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "examples" / "grafana" / "p2p_kv.json"
ALERTS = REPO / "examples" / "prometheus" / "p2p_kv-alerts.yml"
ALERT_TESTS = REPO / "examples" / "prometheus" / "p2p_kv-alerts.test.yml"
DOC = REPO / "docs" / "observability.md"

#: A Prometheus metric name that starts as vLLM's do (``vllm:``).
_NAME = re.compile(r"(?<![A-Za-z0-9_:])vllm:[A-Za-z0-9_:]+")
#: The series a metric of each kind has at /metrics.
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def series_names() -> dict[str, str]:
    """Every series name p2p_kv's metrics have at /metrics -> its metric."""
    return {
        name + suffix: name
        for name, d in DEFINITIONS.items()
        for suffix in SUFFIXES[d.kind]
    }


def _strings(node: Any, keys: set[str]) -> list[str]:
    """The string values under ``keys`` anywhere in a JSON/YAML tree."""
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys and isinstance(v, str):
                out.append(v)
            else:
                out.extend(_strings(v, keys))
    elif isinstance(node, list):
        for v in node:
            out.extend(_strings(v, keys))
    return out


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Panel queries and the template variables' queries."""
    return _strings(dashboard(), {"expr", "query", "definition"})


def doc_queries() -> list[str]:
    """The ```promql blocks of docs/observability.md."""
    return re.findall(r"```promql\n(.*?)```", DOC.read_text(), re.S)


def referenced() -> dict[str, set[str]]:
    """Metric names each shipped file uses, by file: the dashboard's
    queries, the rules' expressions and annotations, the docs' PromQL."""
    alert_text = [r["expr"] for r in alert_rules()]
    alert_text += [v for r in alert_rules() for v in r["annotations"].values()]
    sources = {
        "examples/grafana/p2p_kv.json": dashboard_queries(),
        "examples/prometheus/p2p_kv-alerts.yml": alert_text,
        "docs/observability.md": doc_queries(),
    }
    return {
        src: {m for text in texts for m in _NAME.findall(text)}
        for src, texts in sources.items()
    }


def test_series_names_are_those_the_prometheus_client_writes() -> None:
    """vLLM makes each metric with prometheus_client's classes (its
    labels, then ours): the suffixes above are what that client writes."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    classes = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    for name, d in DEFINITIONS.items():
        labels = ["model_name", "engine", *d.labelnames]
        kwargs: dict[str, Any] = {"registry": registry}
        if d.buckets is not None:
            kwargs["buckets"] = d.buckets
        metric = classes[d.kind](name, d.documentation, labels, **kwargs)
        child = metric.labels(*("x" for _ in labels))
        if d.kind == "histogram":
            child.observe(0.01)
        elif d.kind == "counter":
            child.inc()
        else:
            child.set(1)
    text = generate_latest(registry).decode()
    written = {
        s.name
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert written == set(series_names())
    assert all(name.startswith(PREFIX) for name in written)


@pytest.mark.parametrize("source", sorted(referenced()))
def test_every_metric_named_is_one_p2p_kv_exports(source: str) -> None:
    names = referenced()[source]
    assert names, f"{source} names no metric"
    unknown = sorted(names - set(series_names()))
    assert not unknown, f"{source} names series p2p_kv does not export: {unknown}"


def test_the_dashboard_answers_the_operators_questions() -> None:
    """Hit ratio, fallbacks by reason, load time p50 and p99, bytes per
    peer; every panel query on the data source variable, with a unique id."""
    exprs = _strings(dashboard(), {"expr"})
    flat = [" ".join(e.split()) for e in exprs]

    def has(*parts: str) -> bool:
        return any(all(p in e for p in parts) for e in flat)

    hits, misses = (
        f"{PREFIX}lookup_hit_blocks_total",
        f"{PREFIX}lookup_miss_blocks_total",
    )
    assert has(hits, misses, "/"), "remote hit ratio"
    assert has("sum by (reason)", f"{PREFIX}fallbacks_total"), "fallbacks by reason"
    for q in ("0.5", "0.99"):
        assert has(f"histogram_quantile({q}", f"{PREFIX}load_time_seconds_bucket")
    for metric in ("loaded_bytes_total", "served_bytes_total"):
        assert has("sum by (peer)", f"rate({PREFIX}{metric}"), metric

    d = dashboard()
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables == {"datasource", "model_name", "instance"}
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (p["title"], used)


def test_alert_rules_are_complete_and_each_has_a_promtool_test() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r["alert"]
        assert r["for"] and r["annotations"]["summary"], r["alert"]
        assert r["annotations"]["description"], r["alert"]
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    tested = {
        case["alertname"]
        for t in tests["tests"]
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert tested == set(names), "each rule has a test where it fires"
    doc = DOC.read_text()
    assert all(f"`{n}`" in doc for n in names), "each rule is explained"
    assert f'--8<-- "{ALERTS.relative_to(REPO)}"' in doc
    assert "observability.md" in (REPO / "mkdocs.yml").read_text()


def test_every_alert_has_a_runbook_section_in_operations() -> None:
    """Each alert's runbook_url names a section of docs/operations.md
    that exists, headed by the alert's name (mkdocs' anchor for it)."""
    operations = (REPO / "docs" / "operations.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", operations, re.M))
    for rule in alert_rules():
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == (
            f"docs/operations.md#{name.lower()}"
        ), name
        assert name in headings, f"docs/operations.md has no '### {name}'"
    assert "A failed outbound dial is not an" in operations


def promtool() -> str:
    """promtool: `make test` puts Debian's beside the venv's python."""
    found = shutil.which("promtool", path=str(Path(sys.executable).parent))
    found = found or shutil.which("promtool")
    assert found, (
        "promtool is not installed: `make test` installs it into .venv/bin "
        "(Debian's prometheus package, the one binary)"
    )
    return found


def run_promtool(*args: str) -> None:
    out = subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_pass_their_promtool_tests_and_every_query_parses(
    tmp_path: Path,
) -> None:
    """promtool runs the rules' tests, and parses the dashboard's and the
    docs' queries (as recording rules, Grafana's variables filled in)."""
    run_promtool("test", "rules", str(ALERT_TESTS))
    fill = {"$__rate_interval": "5m", "$instance": ".*", "$model_name": ".*"}
    queries = _strings(dashboard(), {"expr"}) + doc_queries()
    for var, value in fill.items():
        queries = [q.replace(var, value) for q in queries]
    rules = [{"record": f"check:q{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    run_promtool("check", "rules", str(path))
