"""launch/k8s: every kustomization renders offline, validates strictly against the Kubernetes
schemas, and keeps our own rules (probes on ports the processes serve, grace past the drain
deadline, selectors that select, GPUs that match TP, a NetworkPolicy admitting exactly the
intended flows)."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from tandem.router.discovery import parse_workers
from tests.deploy.manifests import (
    K8S, WORKLOADS, Doc, Pod, admitted, container_ports, expanded_args, flag, kubectl,
    kustomizations, load, pod_labels, pod_spec, render, resolve_port,
)

pytestmark = pytest.mark.skipif(kubectl() is None, reason="kubectl is not on PATH: cannot render "
                                "launch/k8s (install kubectl >= 1.27 to run these tests)")

DIRS = kustomizations()
IDS = [str(d.relative_to(K8S)) for d in DIRS]
DEPLOYMENTS = [d for d in DIRS if d.name != "sweep"]  # the sweep Job runs against a deployment
DEPLOYMENT_IDS = [str(d.relative_to(K8S)) for d in DEPLOYMENTS]
GPU_IMAGE = "registry.example.com/tandem:0.1.0"  # workers (SGLang)
CPU_IMAGE = "registry.example.com/tandem:0.1.0-cpu"  # frontends and the sweep: no GPU
UCX_RANGE = (20000, 20999)


@cache
def rendered(directory: Path) -> tuple[str, list[Doc]]:
    text = render(directory)
    return text, load(text)


def docs(directory: Path, kind: str | None = None) -> list[Doc]:
    return [d for d in rendered(directory)[1] if kind is None or d["kind"] == kind]


def workloads(directory: Path) -> list[Doc]:
    return [d for d in docs(directory) if d["kind"] in WORKLOADS]


def component(doc: Doc) -> str:
    return pod_labels(doc)["app.kubernetes.io/component"]


def tandem_container(doc: Doc) -> Doc:
    (c,) = [c for c in pod_spec(doc)["containers"] if c["name"] in ("worker", "frontend", "sweep")]
    return c


def test_the_expected_kustomizations_exist() -> None:
    assert set(IDS) >= {"base", "overlays/rdma", "overlays/2p2d-tp2", "sweep"}


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_renders_and_validates_strictly(directory: Path, tmp_path: Path) -> None:
    text, objs = rendered(directory)
    assert objs, "renders to nothing"
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) \
        or shutil.which("kubernetes-validate")
    if validator is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    out = tmp_path / "rendered.yaml"
    out.write_text(text)
    res = subprocess.run([validator, "--strict", "--quiet", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_validator_rejects_what_it_should(tmp_path: Path) -> None:
    """A control: --strict must fail an unknown field, or the test above proves nothing."""
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) \
        or shutil.which("kubernetes-validate")
    if validator is None:
        pytest.skip("kubernetes-validate is not installed")
    doc = docs(K8S / "base", "Service")[0]
    bad = copy.deepcopy(doc)
    bad["spec"]["publishNotReadyAdresses"] = False  # misspelt
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    res = subprocess.run([validator, "--strict", "--quiet", str(tmp_path / "bad.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_images_users_and_resources(directory: Path) -> None:
    for w in workloads(directory):
        spec = pod_spec(w)
        gpu = component(w) in ("prefill", "decode")
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{w['metadata']['name']}/{c['name']}"
            assert c["image"] == (GPU_IMAGE if gpu else CPU_IMAGE), f"{where}: {c['image']}"
            sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
            if "IPC_LOCK" in sc.get("capabilities", {}).get("add", []):  # RDMA: root's only
                assert sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is False, where
            else:
                assert sc.get("runAsNonRoot") is True, f"{where} may run as root"
            req = c.get("resources", {}).get("requests", {})
            assert "cpu" in req and "memory" in req, f"{c['name']} has no resource requests"


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_processes_serve_what_probes_and_ports_point_at(directory: Path) -> None:
    seen = set()
    for w in workloads(directory):
        role = component(w)
        c = tandem_container(w)
        args = expanded_args(c, {"status.podIP": "10.1.2.3"})
        ports = container_ports(c)
        assert args[:1] == ["tandem"], args
        if role == "frontend":
            assert args[1] == "frontend"
            served = {"http": int(flag(args, "--port") or 8000)}
            probe_port = served["http"]
        else:
            assert args[1] == "worker" and flag(args, "--role") == role, args
            assert flag(args, "--host") == "0.0.0.0"
            assert flag(args, "--advertise-host") == "10.1.2.3"
            served = {"zmq": int(flag(args, "--port") or 0),
                      "health": int(flag(args, "--health-port") or 0)}
            if role == "prefill":
                served["bootstrap"] = int(flag(args, "--bootstrap-port") or 0)
            else:
                assert flag(args, "--bootstrap-port") is None
            probe_port = served["health"]
        assert ports == served, f"{role}: container ports {ports} != what the args serve {served}"
        for kind, path in (("startupProbe", None), ("readinessProbe", "/health"),
                           ("livenessProbe", "/live")):
            probe = c.get(kind)
            assert probe is not None, f"{role} has no {kind}"
            get = probe["httpGet"]
            assert resolve_port(get["port"], c) == probe_port, f"{role} {kind} port"
            assert get["path"] in ("/live", "/health")
            if path:
                assert get["path"] == path, f"{role} {kind} path"
        seen.add(role)
    assert seen == {"frontend", "prefill", "decode"}


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_grace_period_outlasts_the_drain_deadline(directory: Path) -> None:
    for w in workloads(directory):
        if component(w) == "sweep":
            continue
        args = expanded_args(tandem_container(w))
        drain = float(flag(args, "--drain-timeout") or 10.0)  # DRAIN_TIMEOUT_S
        grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
        assert grace > drain, f"{w['metadata']['name']}: grace {grace} s <= drain {drain} s"


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_selectors_services_and_discovery_names(directory: Path) -> None:
    services = {s["metadata"]["name"]: s for s in docs(directory, "Service")}
    loads = workloads(directory)
    for w in loads:  # a workload's selector selects its own pods
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod_labels(w).items()
    for name, svc in services.items():
        sel = svc["spec"]["selector"]
        matched = [w for w in loads if sel.items() <= pod_labels(w).items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        c = tandem_container(matched[0])
        for p in svc["spec"]["ports"]:
            assert resolve_port(p.get("targetPort", p["port"]), c) == p["port"]
    for w in loads:
        role = component(w)
        if w["kind"] == "StatefulSet":
            svc = services[w["spec"]["serviceName"]]
            assert svc["spec"]["clusterIP"] == "None" and \
                svc["spec"]["publishNotReadyAddresses"] is False, "DNS must list ready pods only"
            assert svc["spec"]["selector"].items() <= pod_labels(w).items()
        if role == "frontend":
            targets = parse_workers(flag(expanded_args(tandem_container(w)), "--workers") or "")
            named = {}
            for t in targets:
                assert t.is_dns, f"frontend on Kubernetes should discover by DNS, not {t}"
                svc = services[t.host]
                assert svc["spec"]["clusterIP"] == "None"
                assert t.port in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "zmq"]
                named[svc["spec"]["selector"]["app.kubernetes.io/component"]] = t
            assert set(named) == {"prefill", "decode"}


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_workers_gpus_shm_and_ucx(directory: Path) -> None:
    for w in workloads(directory):
        if component(w) not in ("prefill", "decode"):
            continue
        c = tandem_container(w)
        args = expanded_args(c)
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= 1
        if flag(args, "--engine") == "sglang":
            assert int(flag(args, "--tp-size") or 1) == gpus, "--tp-size differs from the GPU limit"
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e.get("value") for e in c["env"]}
        lo, hi = (int(x) for x in env["UCX_TCP_PORT_RANGE"].split("-"))
        assert (lo, hi) == UCX_RANGE, "UCX ports and the NetworkPolicy's range must agree"
        assert env["UCX_TLS"] and env["UCX_NET_DEVICES"]
        if "rdma" in str(directory) or "2p2d" in str(directory):
            assert "rc" in env["UCX_TLS"].split(",") and env["UCX_NET_DEVICES"].startswith("mlx5")
            assert int(c["resources"]["limits"]["rdma/ib"]) >= 1
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_every_process_has_the_cluster_keys(directory: Path) -> None:
    """ZMQ beyond loopback is CURVE-authenticated: frontends and workers all need the keys."""
    for w in workloads(directory):
        c = tandem_container(w)
        auth = flag(expanded_args(c), "--auth-keys")
        assert auth is not None, f"{component(w)} has no --auth-keys"
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == auth]
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        assert volumes[m["name"]]["secret"]["secretName"] == "tandem-auth-keys"
        assert m.get("readOnly") is True


API_KEYS = "tandem-api-keys"


def frontend_api_keys(directory: Path) -> tuple[str, str]:
    """The Secret and the entry in it that the frontends read with --api-key-file."""
    (w,) = [w for w in workloads(directory) if component(w) == "frontend"]
    c = tandem_container(w)
    path = flag(expanded_args(c), "--api-key-file")
    assert path is not None, "the frontend serves an open API: no --api-key-file"
    (m,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert m.get("readOnly") is True
    secret = {v["name"]: v for v in pod_spec(w)["volumes"]}[m["name"]]["secret"]
    assert secret["defaultMode"] == 0o400
    return secret["secretName"], path[len(m["mountPath"].rstrip("/")) + 1:]


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_frontends_serve_only_api_key_holders(directory: Path) -> None:
    """The API is not open to whoever reaches the Service: the frontends read their keys from a
    Secret (each key a tenant its holder cannot multiply); the workers never see them."""
    assert frontend_api_keys(directory) == (API_KEYS, "keys")
    for w in workloads(directory):
        if component(w) != "frontend":
            assert "--api-key-file" not in expanded_args(tandem_container(w))


def test_the_production_example_overlay_really_changes_things() -> None:
    by_name = {w["metadata"]["name"]: w for w in workloads(K8S / "overlays" / "2p2d-tp2")}
    for name in ("tandem-prefill", "tandem-decode"):
        w = by_name[name]
        assert w["spec"]["replicas"] == 2
        assert w["metadata"]["namespace"] == "tandem"
        c = tandem_container(w)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert flag(expanded_args(c), "--tp-size") == "2"
        assert flag(expanded_args(c), "--auth-keys") == "/etc/tandem/auth-keys"
    assert by_name["tandem-frontend"]["spec"]["replicas"] == 4


# --- NetworkPolicy ------------------------------------------------------------------------------

def intended(src: str, dst: str, port: str) -> bool:
    """The flows the design wants, by port name ('ucx' = the UCX_TCP_PORT_RANGE)."""
    if port in ("health", "http"):
        return True
    if port == "zmq":
        return src == "frontend"
    if port == "bootstrap":
        return dst == "prefill" and src == "decode"
    if port == "ucx":
        return {src, dst} == {"prefill", "decode"}
    return False


def flow_mismatches(policies: list[Doc], loads: list[Doc]) -> list[str]:
    dsts = {component(w): Pod(component(w), pod_labels(w), container_ports(tandem_container(w)))
            for w in loads if component(w) in ("frontend", "prefill", "decode")}
    srcs = list(dsts.values()) + [
        Pod("sweep", {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/component": "sweep"}),
        Pod("other-pod", {"app": "something-else"}),
        Pod("outside", None),
    ]
    bad = []
    for dst in dsts.values():
        probes: list[tuple[str, int]] = list(dst.ports.items())
        probes += [("ucx", UCX_RANGE[0]), ("ucx", UCX_RANGE[1]), ("ucx", 20500),
                   ("other", UCX_RANGE[0] - 1), ("other", UCX_RANGE[1] + 1), ("other", 22),
                   ("other", 9999)]
        for src in srcs:
            for port_name, port in probes:
                got = admitted(policies, src, dst, port)
                if got != intended(src.name, dst.name, port_name):
                    bad.append(f"{src.name} -> {dst.name}:{port} ({port_name}): "
                               f"{'admitted' if got else 'denied'}")
    return bad


@pytest.mark.parametrize("directory", DEPLOYMENTS, ids=DEPLOYMENT_IDS)
def test_network_policy_admits_exactly_the_intended_flows(directory: Path) -> None:
    policies = docs(directory, "NetworkPolicy")
    assert policies
    assert flow_mismatches(policies, workloads(directory)) == []


def test_the_flow_check_catches_a_loosened_policy() -> None:
    """Controls: each mutation opens or closes a flow, and the check must notice."""
    base = K8S / "base"
    policies, loads = docs(base, "NetworkPolicy"), workloads(base)
    by_name = {p["metadata"]["name"]: p for p in policies}

    def mutated(edit) -> list[str]:
        pols = copy.deepcopy(policies)
        edit({p["metadata"]["name"]: p for p in pols})
        return flow_mismatches(pols, loads)

    def open_zmq(p: dict) -> None:
        del p["tandem-prefill"]["spec"]["ingress"][0]["from"]

    def widen_ucx(p: dict) -> None:
        p["tandem-decode"]["spec"]["ingress"][1]["ports"][0]["endPort"] = 21000

    def drop_bootstrap(p: dict) -> None:
        p["tandem-prefill"]["spec"]["ingress"][1]["ports"].pop(0)

    def drop_decode_policy(p: dict) -> None:
        labels = p["tandem-decode"]["spec"]["podSelector"]["matchLabels"]
        labels["app.kubernetes.io/component"] = "x"

    assert by_name and mutated(lambda p: None) == []
    assert any("other-pod -> prefill:7100" in m for m in mutated(open_zmq))
    assert any("prefill -> decode:21000" in m for m in mutated(widen_ucx))
    assert any("decode -> prefill:7200 (bootstrap): denied" in m for m in mutated(drop_bootstrap))
    assert any("outside -> decode:7100" in m for m in mutated(drop_decode_policy))


# --- the sweep Job ------------------------------------------------------------------------------

def test_sweep_job_targets_the_frontend_service_and_keeps_results() -> None:
    (job,) = docs(K8S / "sweep", "Job")
    pvcs = {p["metadata"]["name"] for p in docs(K8S / "sweep", "PersistentVolumeClaim")}
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    c = tandem_container(job)
    args = expanded_args(c, {"metadata.name": "tandem-sweep-abcde"})
    assert args[:3] == ["python", "-m", "perf.streaming.sweep"]
    from perf.streaming.sweep import parse_args  # the Job's args must parse as perf.streaming.sweep's own
    parsed = parse_args(args[3:])
    assert parsed.concurrency and all(n >= 1 for n in parsed.concurrency)
    host, port = parsed.url.removeprefix("http://").split(":")
    frontends = {s["metadata"]["name"]: s for s in docs(K8S / "base", "Service")}
    assert int(port) in [p["port"] for p in frontends[host]["spec"]["ports"]]
    frontend_args = expanded_args(tandem_container(
        [w for w in workloads(K8S / "base") if component(w) == "frontend"][0]))
    assert Path(parsed.model).name == Path(flag(frontend_args, "--model") or "").name
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = [m for m in c["volumeMounts"] if parsed.out.startswith(m["mountPath"] + "/")]
    assert len(mounts) == 1, f"--out {parsed.out} is not on a mounted volume"
    assert volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"] in pvcs
    assert "tandem-sweep-abcde" in parsed.out  # one directory per run
    # It presents one of the keys the frontends take (sweep.API_KEY_ENV, from their Secret).
    from perf.streaming.sweep import API_KEY_ENV
    (env,) = [e for e in c["env"] if e["name"] == API_KEY_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == frontend_api_keys(K8S / "base")
    assert job["metadata"]["namespace"] == "tandem"
