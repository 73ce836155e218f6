"""deploy/: the Prometheus alert rules, the Grafana dashboard and the Kubernetes base, checked without a
cluster. Rules and panels: their shape, every PromQL expression parses (promql-parser, Prometheus'
own grammar), and every series they name is one the code exports, found by running the exporters'
collectors (the ledger's on a seeded embedded ledger, the breakers', every process metric), not
from a list kept by hand. Kubernetes: the kustomize base rendered (its resources, labels and
images) and each object validated against the Kubernetes schema (kubernetes-validate), plus what
the schema cannot know: numeric non-root user, probes, grace period over the hard time limit,
commands that exist, settings that exist, KEDA not on CPU."""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry
from sqlalchemy import update

from breaker.metrics import BreakerCollector
from outbox.evidence.handoffs import open_handoff
from outbox.ledger.clock import db_now
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.models import Handoff
from outbox.migrate import upgrade
from outbox.reads.metrics import LedgerCollector
from outbox.reads.report_summary import record_report
from outbox.settings import Settings
from producer import submit
from tests.harness import REFUND_ARGS
from workers.cli.main import build_parser, command_in
from workers.ground.metrics import PROCESS_REGISTRY
from workers.provider.actions import load_actions

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
RULES = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
DASHBOARD = json.loads((DEPLOY / "grafana" / "agent-outbox.json").read_text())
K8S_VERSION = "1.30.0"
NAME = re.compile(r"\boutbox_[a-z0-9_]+")


def rules() -> list[dict[str, Any]]:
    return [rule for group in RULES["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]


def families(collectors: Iterator[Any]) -> set[str]:
    """Every sample name a family of these collectors can expose (counters' _total, histograms' parts)."""
    out: set[str] = set()
    for family in collectors:
        out.add(family.name)
        if family.type == "counter":
            out |= {f"{family.name}_total", f"{family.name}_created"}
        if family.type == "histogram":
            out |= {f"{family.name}_{part}" for part in ("bucket", "sum", "count", "created")}
        out |= {s.name for s in family.samples}
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What `agent-outbox metrics`, the workers and the API export: the ledger's collector on an
    embedded ledger seeded so that every family appears (a report, a resolved handoff), the
    breakers' collector, and every process metric."""
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('deploy') / 'ledger.db'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as s:
        op = submit(s, tenant="t", idempotency_key="k", action="a", args=dict(REFUND_ARGS), subject="x").operation_id
        hid = open_handoff(s, op, reason="r", packet={})
        s.execute(update(Handoff).where(Handoff.id == hid).values(status="resolved", resolved_at=db_now()))
        now = dt.datetime.now(dt.UTC)
        health = {
            "operations": 1,
            "duplicate_effects": 0,
            "failure_attributability": {"share": 1.0},
            "auto_recovery": {"rate": 1.0},
            "first_time_resolution": {"ratio": 1.0},
            "possible_duplicates_by_object": 0,
            "key_conflicts": 0,
            "key_replays": 0,
        }
        doc = {"since": now.isoformat(), "health": health, "discrepancy_count": 0, "complete": True}
        record_report(s, doc | {"discrepancies": {}}, started_at=now, finished_at=now, ran_by="test")
    registry = CollectorRegistry()
    registry.register(LedgerCollector(engine, tenants=1))
    names = families(registry.collect()) | families(PROCESS_REGISTRY.collect())
    # The breakers' collector as it reads Redis (no server here: its read answers "no targets open").
    with mock.patch("breaker.metrics.status", return_value=[]):
        names |= families(BreakerCollector("redis://127.0.0.1:1/0", ["t"]).collect())
    engine.dispose()
    return names


def test_every_alert_rule_is_complete():
    assert [g["name"] for g in RULES["groups"]] == ["agent-outbox"]
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
    # What the issue asked to be alerted on, each by its series.
    wanted = {
        "outbox_oldest_due_age_seconds",
        "outbox_outcome_unknown_backlog",
        "outbox_handoffs_open",
        "outbox_breaker_state",
        "outbox_report_duplicate_effects",
        "outbox_ledger_up",
    }
    assert wanted <= {n for r in rules() for n in NAME.findall(r["expr"])}


@pytest.mark.parametrize(
    "expr", [r["expr"] for r in rules()] + dashboard_exprs(), ids=lambda e: e[:60]
)  # fmt: skip
def test_every_expression_parses(expr: str):
    promql_parser.parse(expr)


def test_a_broken_expression_would_be_caught():
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(outbox_attempts_total[5m])")


def test_every_series_named_is_exported(exported: set[str]):
    keda = [
        t["metadata"]["query"] for obj in rendered() if obj["kind"] == "ScaledObject" for t in obj["spec"]["triggers"]
    ]
    named = {n for e in [r["expr"] for r in rules()] + dashboard_exprs() + keda for n in NAME.findall(e)}
    assert named, "no series found"
    assert named - exported == set()
    # And the dashboard shows the seeds' figures and the API's.
    shown = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert {
        "outbox_report_duplicate_effect_ratio",
        "outbox_failure_attributability_ratio",
        "outbox_auto_recovery_ratio",
        "outbox_first_time_resolution_ratio",
        "outbox_report_possible_duplicates_by_object",
        "outbox_report_key_conflicts",
        "outbox_report_key_replays",
        "outbox_handoff_takeover_seconds_bucket",
        "outbox_handoff_ratio",
        "outbox_retry_billed_calls_total",
        "outbox_http_requests_total",
        "outbox_http_request_duration_seconds_bucket",
    } <= shown


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_input():
    assert DASHBOARD["uid"] == "agent-outbox" and DASHBOARD["__inputs"][0]["name"] == "DS_PROMETHEUS"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for p in DASHBOARD["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"


# -- Kubernetes ------------------------------------------------------------------------------
def rendered() -> list[dict[str, Any]]:
    """kustomize build of the base, for what it uses: resources, labels (not selectors), images."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "labels", "images", "resources"}, "teach rendered() the new field"
    objects = [o for res in kust["resources"] for o in yaml.safe_load_all((BASE / res).read_text()) if o]
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kust.get("images", [])}
    for obj in objects:
        for label in kust.get("labels", []):
            assert label.get("includeSelectors") is False
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
        for pod in pod_specs(obj):
            for c in pod["containers"]:
                c["image"] = images.get(c["image"], c["image"])
    return objects


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] in ("Deployment", "Job"):
        return [obj["spec"]["template"]["spec"]]
    return []


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered() if o["kind"] == kind]


@pytest.mark.parametrize(
    "obj", [o for o in rendered() if o["kind"] != "ScaledObject"], ids=lambda o: f"{o['kind']}/{o['metadata']['name']}"
)
def test_every_object_is_valid_kubernetes(obj: dict[str, Any]):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_schema_check_would_catch_a_typo():
    [api] = [o for o in rendered() if o["metadata"]["name"] == "agent-outbox-api" and o["kind"] == "Deployment"]
    api["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, K8S_VERSION, strict=True)


def test_every_pod_runs_as_the_images_numeric_user_with_probes_and_resources():
    uid = int(re.search(r"^USER (\d+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1))  # type: ignore[union-attr]
    hard_limit_s = Settings().time_limit_s
    for obj in by_kind("Deployment") + by_kind("Job"):
        name = obj["metadata"]["name"]
        [pod] = pod_specs(obj)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid, name
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], name
            assert c["image"].startswith("registry.example.com/agent-outbox:"), name
            if obj["kind"] == "Deployment":
                assert "livenessProbe" in c and "readinessProbe" in c, name
        if obj["kind"] == "Deployment" and pod["containers"][0]["command"][:4] == ["celery", "-A", "workers", "worker"]:
            # Kubernetes must not kill a call the worker would still finish (warm shutdown).
            assert pod["terminationGracePeriodSeconds"] > hard_limit_s, name


def test_every_command_exists_and_every_setting_is_known():
    known = {f"OUTBOX_{f.upper()}" for f in Settings.model_fields}
    [config] = [o for o in by_kind("ConfigMap") if o["metadata"]["name"] == "agent-outbox-config"]
    assert by_kind("Secret") == [], "apply -k must never overwrite real credentials"
    secret = yaml.safe_load((BASE / "secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    refs = {r["secretRef"]["name"] for o in by_kind("Deployment") for c in pod_specs(o)[0]["containers"]
            for r in c["envFrom"] if "secretRef" in r}  # fmt: skip
    assert refs == {secret["metadata"]["name"]}
    names = set(config["data"]) | set(secret["stringData"])
    for obj in by_kind("Deployment") + by_kind("Job"):
        [pod] = pod_specs(obj)
        for c in pod["containers"]:
            names |= {e["name"] for e in c.get("env", [])}
            argv = c["command"]
            if argv[0] == "agent-outbox":
                build_parser(command_in(argv[1:])).parse_args(argv[1:])  # exits on an unknown command or flag
            else:
                assert argv[:4] in (["celery", "-A", "workers", "worker"], ["celery", "-A", "workers", "beat"]), argv
            for probe in ("livenessProbe", "readinessProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command")
                if command:
                    assert command[0] == "agent-outbox"
                    build_parser(command_in(command[1:])).parse_args(command[1:])
    unknown = {n for n in names if n.startswith("OUTBOX_")} - known
    assert unknown == set(), unknown
    assert {"OUTBOX_DATABASE_URL", "OUTBOX_BROKER_URL", "OUTBOX_REDIS_URL"} <= set(secret["stringData"])


def test_the_actions_file_in_the_base_loads(tmp_path, monkeypatch):
    [cm] = [o for o in by_kind("ConfigMap") if o["metadata"]["name"] == "agent-outbox-actions"]
    path = tmp_path / "actions.yaml"
    path.write_text(cm["data"]["actions.yaml"])
    assert load_actions(path).actions


def test_wiring_selectors_services_and_the_singletons():
    deployments = {o["metadata"]["name"]: o for o in by_kind("Deployment")}
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for d in deployments.values():
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for svc in by_kind("Service"):
        [target] = [n for n, labels in pods.items() if svc["spec"]["selector"].items() <= labels.items()]
        ports = {p["name"] for c in deployments[target]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc["metadata"]["name"]
    for pdb in by_kind("PodDisruptionBudget"):
        [target] = [n for n, labels in pods.items() if pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert deployments[target]["spec"]["replicas"] > pdb["spec"]["minAvailable"], "a PDB that blocks every drain"
    assert {p["metadata"]["name"] for p in by_kind("PodDisruptionBudget")} == {
        "agent-outbox-worker",
        "agent-outbox-api",
    }
    beat = deployments["agent-outbox-beat"]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"  # never two beats
    [job] = by_kind("Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["agent-outbox", "migrate"]


def test_keda_scales_workers_on_work_not_cpu():
    deployments = {o["metadata"]["name"] for o in by_kind("Deployment")}
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in by_kind("ScaledObject")}
    assert set(scaled) == {"agent-outbox-worker", "agent-outbox-reconciler"} and set(scaled) <= deployments
    for obj in scaled.values():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus", "never cpu or memory: the workers wait on providers"
            promql_parser.parse(trigger["metadata"]["query"])
            assert float(trigger["metadata"]["threshold"]) > 0
    queries = " ".join(t["metadata"]["query"] for t in scaled["agent-outbox-worker"]["spec"]["triggers"])
    assert "outbox_in_flight_operations" in queries and 'outbox_operations{status="not_dispatched"}' in queries


def test_the_compose_file_and_the_base_run_the_same_commands():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    commands = {
        o["metadata"]["name"].removeprefix("agent-outbox-"): pod_specs(o)[0]["containers"][0]["command"]
        for o in by_kind("Deployment") + by_kind("Job")
    }
    for name, argv in commands.items():
        assert argv == compose[name]["command"], (name, shlex.join(argv), shlex.join(compose[name]["command"]))
