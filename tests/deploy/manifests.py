"""Helpers for the deployment tests: render the kustomizations under launch/k8s, read what the
containers' args say (after Kubernetes' $(VAR) expansion), and a small NetworkPolicy evaluator.

The evaluator implements the ingress subset of networking.k8s.io/v1 that a policy of ours may use
(podSelector with matchLabels/matchExpressions, an empty namespaceSelector, ipBlock 0.0.0.0/0,
numbered and named ports, endPort, TCP); anything else raises, so a new construct cannot be
silently misjudged.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "launch" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")

Doc = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomizations() -> list[Path]:
    """Every directory under launch/k8s that renders on its own (Components do not)."""
    out = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            out.append(path.parent)
    return out


def render(directory: Path) -> str:
    exe = kubectl()
    assert exe is not None
    res = subprocess.run([exe, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, f"kubectl kustomize {directory} failed:\n{res.stderr}"
    return res.stdout


def load(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def pod_spec(doc: Doc) -> Doc:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def pod_labels(doc: Doc) -> dict[str, str]:
    return dict(doc["spec"]["template"]["metadata"].get("labels", {}))


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expanded_args(container: Doc, fieldrefs: dict[str, str] | None = None) -> list[str]:
    """command + args as the kubelet runs them: $(VAR) replaced from the container's env (plain
    values, and fieldRef values from `fieldrefs`); an unknown $(VAR) stays as written, as there."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif fieldrefs and "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            if path in fieldrefs:
                env[e["name"]] = fieldrefs[path]
    words = [str(w) for w in container.get("command", []) + container.get("args", [])]
    return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), w) for w in words]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` (the last one wins, as with argparse)."""
    value = None
    for i, word in enumerate(args):
        if word == name and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def container_ports(container: Doc) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports", []) if "name" in p}


def resolve_port(port: int | str, container: Doc) -> int:
    if isinstance(port, int):
        return port
    ports = container_ports(container)
    assert port in ports, f"named port {port!r} not declared by container {container['name']}"
    return ports[port]


# --- NetworkPolicy ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pod:
    """A pod as the evaluator sees it; `labels` None means a client outside the namespace's pods
    (a node's kubelet, another namespace, the internet)."""

    name: str
    labels: dict[str, str] | None
    ports: dict[str, int] = field(default_factory=dict)


def selector_matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise NotImplementedError(op)
    return True


def _peer_admits(peer: Doc, src: Pod) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if block.get("cidr") != "0.0.0.0/0" or block.get("except"):
            raise NotImplementedError(f"ipBlock {block}")
        return src.labels is None
    if peer.get("namespaceSelector"):
        raise NotImplementedError("a non-empty namespaceSelector")
    if src.labels is None:
        return False  # pod and namespace selectors only ever match pods
    return selector_matches(peer.get("podSelector"), src.labels)


def _port_admits(rule_ports: list[Doc] | None, port: int, dst: Pod) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        want = p["port"]
        if isinstance(want, str):
            if dst.ports.get(want) == port:
                return True
            continue
        if int(want) <= port <= int(p.get("endPort") or want):
            return True
    return False


def admitted(policies: list[Doc], src: Pod, dst: Pod, port: int) -> bool:
    """Whether TCP from `src` to `dst`:`port` is admitted by these policies (same namespace)."""
    assert dst.labels is not None
    selecting = []
    for pol in policies:
        spec = pol["spec"]
        types = spec.get("policyTypes") or (
            ["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        if "Ingress" in types and selector_matches(spec.get("podSelector"), dst.labels):
            selecting.append(spec)
    if not selecting:
        return True  # a pod no policy selects is not isolated
    for spec in selecting:
        for rule in spec.get("ingress") or []:
            peers = rule.get("from")
            if (not peers or any(_peer_admits(p, src) for p in peers)) and \
                    _port_admits(rule.get("ports"), port, dst):
                return True
    return False
