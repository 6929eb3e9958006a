"""The Helm chart (deploy/helm/hedgerow), without the helm binary (none can be had here,
not from PyPI either): it is generated from the kustomize overlay by
scripts/build_helm_chart.py, and this test renders its templates with a renderer for
the small subset of Helm's template language the chart uses (``.Values`` lookups,
``toYaml | nindent``, ``if``/``end``, whitespace trimming) — not with Helm itself; a
construct outside that subset fails here. ``helm lint``/``helm template`` are verified
only where helm is installed (docs/deploy-kubernetes.md)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .test_manifests import REPO, build
from .test_rbac import granted

CHART = REPO / "deploy" / "helm" / "hedgerow"
_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class UnsupportedTemplate(ValueError):
    pass


def lookup(expr: str, values: dict[str, Any]) -> Any:
    if not expr.startswith(".Values."):
        raise UnsupportedTemplate(expr)
    value: Any = values
    for part in expr.removeprefix(".Values.").split("."):
        value = value[part]
    return value


def evaluate(expr: str, values: dict[str, Any]) -> str:
    m = re.fullmatch(r"toYaml (\S+) \| nindent (\d+)", expr)
    if m:
        dumped = yaml.safe_dump(lookup(m[1], values), sort_keys=True, width=1000).rstrip("\n")
        pad = " " * int(m[2])
        return "\n" + "\n".join(pad + line for line in dumped.split("\n"))
    if re.fullmatch(r"\.Values\.[\w.]+", expr):
        return str(lookup(expr, values))
    raise UnsupportedTemplate(expr)


def render(template: str, values: dict[str, Any]) -> str:
    out: list[str] = []
    emitting = [True]
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        if trim_next:
            text = text.lstrip()
        if m[1]:
            text = text.rstrip()
        if all(emitting):
            out.append(text)
        expr = m[2]
        if expr.startswith("if "):
            emitting.append(bool(lookup(expr[3:], values)))
        elif expr == "end":
            if len(emitting) == 1:
                raise UnsupportedTemplate("end without if")
            emitting.pop()
        elif all(emitting):
            out.append(evaluate(expr, values))
        pos, trim_next = m.end(), bool(m[3])
    text = template[pos:]
    out.append(text.lstrip() if trim_next else text)
    return "".join(out)


def render_chart(overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path, value in (overrides or {}).items():
        *parents, leaf = path.split(".")
        node = values
        for part in parents:
            node = node[part]
        node[leaf] = value
    docs = []
    for template in sorted((CHART / "templates").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(render(template.read_text(), values)) if d]
    return docs


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_committed_chart_is_what_the_generator_writes(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_helm_chart.py"), str(tmp_path / "c")],
        check=True,
    )
    written = {p.relative_to(tmp_path / "c"): p.read_text() for p in (tmp_path / "c").rglob("*.*")}
    committed = {p.relative_to(CHART): p.read_text() for p in CHART.rglob("*.*")}
    assert written == committed, "run scripts/build_helm_chart.py after changing deploy/"


def test_the_chart_renders_what_kustomize_builds() -> None:
    rendered, built = by_key(render_chart()), by_key(build("deploy/overlays/example"))
    assert rendered.keys() == built.keys()
    for key, doc in built.items():
        assert rendered[key] == doc, key
    docs = list(rendered.values())
    for deployment in ("hedgerow-web", "hedgerow-worker", "hedgerow-watcher", "hedgerow-beat"):
        assert granted(docs, deployment) == granted(list(built.values()), deployment)


def test_values_change_the_image_the_migrate_job_the_instance_and_the_replicas() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config = copy.deepcopy(values["config"])
    config["HEDGEROW_INSTANCE"] = "staging"
    docs = render_chart(
        {
            "image.repository": "reg.example/hr",
            "image.tag": "2.0.0",
            "web.replicas": 5,
            "priorityClass.create": False,
            "config": config,
        }
    )
    kinds = by_key(docs)
    assert ("Job", "hedgerow-migrate-2.0.0") in kinds
    assert not [d for d in docs if d["kind"] == "PriorityClass"]
    assert kinds[("Deployment", "hedgerow-web")]["spec"]["replicas"] == 5
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "Job")
        for c in d["spec"]["template"]["spec"]["containers"]
        + d["spec"]["template"]["spec"].get("initContainers", [])
    }
    assert images == {"reg.example/hr:2.0.0"}
    worker = kinds[("Deployment", "hedgerow-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert "staging.cold" in worker["command"]
    policy = kinds[("NetworkPolicy", "hedgerow-staging-default")]
    assert policy["metadata"]["labels"]["hedgerow.dev/instance"] == "staging"
    assert kinds[("ConfigMap", "hedgerow-config")]["data"]["HEDGEROW_INSTANCE"] == "staging"
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_renderer_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(UnsupportedTemplate):
        render('{{ include "x" . }}', {})
    assert render(
        "a: {{ .Values.x }}\n{{- if .Values.y }}\nb: 1\n{{- end }}\n", {"x": 1, "y": 0}
    ) == ("a: 1\n")
