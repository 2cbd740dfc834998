"""The Helm chart (deploy/helm/paramserver), checked without a cluster.

``helm lint --strict``; ``helm template`` for every value set in the chart's ``ci/`` folder;
strict schema validation of every rendered object (``kubernetes-validate``, which ships the
Kubernetes API schemas); and assertions on the rendered objects, each expected value derived
from the objects themselves or from the value set (never from the templates): the shard
address list is exactly the StatefulSet's stable DNS names behind its headless Service, ports
agree between flags, container ports, Service and probes, the probes use the standard gRPC
health service, the pod ordinal / Job completion index become --shard-index / --worker-index,
the grace period outlasts --grace-s, and every rendered ``paramserver`` command line parses
with the real CLI parser (and a shard's builds a valid server config).

Needs helm (``PARAMSERVER_HELM``, ``helm`` on PATH, or the cache ``scripts/helm_check.sh``
fills) and the ``helm`` extra (kubernetes-validate, PyYAML); skipped, saying so, otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML: pip install 'paramserver[helm]'")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate: pip install 'paramserver[helm]'"
)

pytestmark = [pytest.mark.helm, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "paramserver"
VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))
NAMESPACE = "ml"
#: Oldest Kubernetes the chart supports (Chart.yaml kubeVersion; backoffLimitPerIndex) and the
#: newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def find_helm() -> str | None:
    given = os.environ.get("PARAMSERVER_HELM")
    if given:
        return given
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    cache = Path(
        os.environ.get("PARAMSERVER_TOOLS_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paramserver-tools"
    )
    found = sorted(cache.glob("helm-*/helm"))
    return str(found[-1]) if found else None


HELM = find_helm()
if HELM is None:
    pytest.skip(
        "no helm binary (run scripts/helm_check.sh, which fetches one, or set PARAMSERVER_HELM)",
        allow_module_level=True,
    )


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], capture_output=True, text=True, timeout=60, check=check, env=os.environ
    )


def render(values: Path | None, *extra: str) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", NAMESPACE, *extra]
    if values is not None:
        args += ["-f", str(values)]
    out = helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def values_of(path: Path) -> dict[str, Any]:
    """The chart's defaults overlaid with a value set (dicts merged, the rest replaced)."""

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base.get(k), over[k]) if k in base else over[k] for k in over} | {
                k: v for k, v in base.items() if k not in over
            }
        return over

    return dict(
        merge(
            yaml.safe_load((CHART / "values.yaml").read_text()),
            yaml.safe_load(path.read_text()) or {},
        )
    )


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` / bare ``--name`` arguments -> {name: value}."""
    out = {}
    for a in args:
        if a.startswith("--"):
            name, _, value = a[2:].partition("=")
            out[name] = value
    return out


def env_field(container: dict[str, Any], name: str) -> str:
    (var,) = [e for e in container["env"] if e["name"] == name]
    return str(var["valueFrom"]["fieldRef"]["fieldPath"])


def probe_port_and_service(probe: dict[str, Any]) -> tuple[int, str, str]:
    """(port, health service name, kind) of a probe: a gRPC probe, or the TLS exec form."""
    if "grpc" in probe:
        return int(probe["grpc"]["port"]), str(probe["grpc"].get("service", "")), "grpc"
    cmd = probe["exec"]["command"]
    assert cmd[:2] == ["paramserver", "health"], cmd
    f = flags(cmd[2:])
    return int(f["server"].rsplit(":", 1)[1]), f["service"], "exec"


def test_lint_strict() -> None:
    for values in [None, *VALUE_SETS]:
        extra = [] if values is None else ["-f", str(values)]
        result = helm("lint", "--strict", str(CHART), *extra, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_there_are_three_value_sets_at_least() -> None:
    assert len(VALUE_SETS) >= 3, VALUE_SETS


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_pass_strict_schema_validation(values: Path, version: str) -> None:
    objs = render(values)
    assert objs
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {exc}")


def test_schema_validation_catches_a_bad_object() -> None:
    """The validator is not a no-op: an unknown field in a StatefulSet is refused."""
    sts = by_kind(render(None), "StatefulSet")[0]
    sts["spec"]["replicaCount"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_shards_workers_and_rank_servers_agree(values: Path) -> None:
    from paramserver.cli.main import build_parser
    from paramserver.cli.serve import serve_config
    from paramserver.protocol.addresses import parse_addresses

    v = values_of(values)
    objs = render(values)
    services = {o["metadata"]["name"]: o for o in by_kind(objs, "Service")}
    sets = {o["metadata"]["name"]: o for o in by_kind(objs, "StatefulSet")}
    (shards,) = [
        s
        for s in sets.values()
        if s["spec"]["template"]["spec"]["containers"][0]["name"] == "shard"
    ]
    svc = services[shards["spec"]["serviceName"]]
    pod = shards["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    f = flags(c["args"])
    copies = v["shards"]["replication"]["replicasPerShard"]  # replicas of each shard
    replicas = v["shards"]["replicas"]  # shards
    pods = shards["spec"]["replicas"]
    assert pods == replicas * copies

    # Stable addresses: pod <sts>-<i> of a headless Service is <sts>-<i>.<svc>.<ns>.svc.<domain>.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert shards["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    port = int(f["port"])
    pod_addresses = [
        f"{shards['metadata']['name']}-{n}.{svc['metadata']['name']}.{NAMESPACE}.svc."
        f"{v['clusterDomain']}:{port}"
        for n in range(pods)
    ]
    # shard i: its pods i * copies .. i * copies + copies - 1, joined by "|"
    groups = [pod_addresses[i * copies : (i + 1) * copies] for i in range(replicas)]
    expected = ["|".join(g) for g in groups]
    assert f["shard-addresses"].split(",") == expected

    # Ports agree: flag, container port, Service port (by name), probes.
    (grpc_port,) = [p for p in c["ports"] if p["name"] == "grpc"]
    assert grpc_port["containerPort"] == port == v["shards"]["port"]
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    assert svc_port["port"] == port and svc_port["targetPort"] == "grpc"
    kinds = set()
    for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe_port, service, kind = probe_port_and_service(c[probe_name])
        kinds.add(kind)
        assert probe_port == port
        assert service in ("", "paramserver.api.v1.ParameterServer")
    # With replicas only the primary serves the service: every replica is ready when it answers.
    ready_service = "" if copies > 1 else "paramserver.api.v1.ParameterServer"
    assert probe_port_and_service(c["readinessProbe"])[1] == ready_service
    assert kinds == ({"exec"} if v["tls"]["enabled"] else {"grpc"})
    if v["shards"]["metricsPort"]:
        assert int(f["metrics-port"]) == v["shards"]["metricsPort"]
        assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics"}
    else:
        assert "metrics-port" not in f

    # Shard (and replica) index from the pod ordinal; state on the pod's own volume.
    if copies > 1:
        assert f["ordinal"] == "$(SHARD_INDEX)" and "shard-index" not in f
        assert int(f["replicas"]) == copies
        assert f["election-endpoints"] == v["shards"]["replication"]["etcdEndpoints"]
    else:
        assert f["shard-index"] == "$(SHARD_INDEX)"
    assert env_field(c, "SHARD_INDEX") == "metadata.labels['apps.kubernetes.io/pod-index']"
    (claim,) = shards["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert f["checkpoint-dir"].startswith(mount["mountPath"] + "/")
    assert claim["spec"]["resources"]["requests"]["storage"] == v["shards"]["persistence"]["size"]
    if v["shards"]["wal"]:
        assert "wal" in f and f["wal-dir"].startswith(mount["mountPath"] + "/")
    # Graceful stop within the pod's grace period: --grace-s, then the final checkpoint.
    assert float(f["grace-s"]) == v["shards"]["graceS"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(f["grace-s"])
    assert f["consistency"] == v["consistency"]

    # The rendered command line is what `paramserver serve` accepts, for every pod: pod n is
    # replica n % copies of shard n // copies, with its shard's pods as its replicas.
    for n in range(pods):
        argv = [a.replace("$(SHARD_INDEX)", str(n)) for a in c["args"]]
        args = build_parser().parse_args(argv)
        assert args.command == "serve"
        if not v["tls"]["enabled"] and not v["auth"]["enabled"]:  # needs the files
            config = serve_config(args, {})
            assert config.shard_index == n // copies
            assert list(parse_addresses(config.shard_addresses)) == expected
            if copies > 1:
                assert config.replica_index == n % copies
                assert list(config.replica_address_list) == groups[n // copies]
                assert pod_addresses[n] in config.replica_address_list

    jobs = by_kind(objs, "Job")
    if v["workers"]["enabled"]:
        (job,) = jobs
        spec = job["spec"]
        (w,) = spec["template"]["spec"]["containers"]
        assert spec["completionMode"] == "Indexed"
        n = v["workers"]["replicas"]
        assert spec["completions"] == spec["parallelism"] == n
        assert spec["backoffLimitPerIndex"] == v["workers"]["backoffLimitPerIndex"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert (
            env_field(w, "WORKER_INDEX")
            == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        )
        if v["workers"]["command"]:  # the user's script: its command, args and image
            assert w["command"] == v["workers"]["command"]
            assert w.get("args", []) == v["workers"]["args"]
            image = v["workers"]["image"]
            assert w["image"] == f"{image['repository']}:{image['tag']}"
            assert w["imagePullPolicy"] == image["pullPolicy"]
        else:  # the digits job of `paramserver worker`
            wf = flags(w["args"])
            assert "command" not in w
            assert w["image"] == f"{v['image']['repository']}:{v['image']['tag']}"
            assert int(wf["num-workers"]) == n
            assert wf["worker-index"] == "$(WORKER_INDEX)"
            assert wf["server"] in expected
            assert "replace" in wf  # a retried index fences its dead predecessor's registration
            assert float(wf["retry-deadline-s"]) == v["workers"]["retryDeadlineS"]
            for i in range(n):
                argv = [a.replace("$(WORKER_INDEX)", str(i)) for a in w["args"]]
                args = build_parser().parse_args(argv)
                assert args.command == "worker" and args.worker_index == i and args.replace
        if v["workers"]["waitForShards"]:
            (init,) = spec["template"]["spec"]["initContainers"]
            script = init["command"][-1]
            assert all(a in script for a in expected)
    else:
        assert not jobs

    ranks = [s for s in sets.values() if s is not shards]
    if v["rankServers"]["enabled"]:
        assert len(ranks) == len(v["rankServers"]["instances"])
        for sts in ranks:
            (rc,) = sts["spec"]["template"]["spec"]["containers"]
            rsvc = services[sts["spec"]["serviceName"]]
            assert rsvc["spec"]["clusterIP"] == "None"
            assert sts["spec"]["replicas"] == v["rankServers"]["ranks"]
            rf = flags(rc["args"])
            assert rf["rank"] == "$(RANK)"
            assert env_field(rc, "RANK") == "metadata.labels['apps.kubernetes.io/pod-index']"
            assert probe_port_and_service(rc["readinessProbe"])[0] == int(rf["port"])
            args = build_parser().parse_args([a.replace("$(RANK)", "1") for a in rc["args"]])
            assert args.command == "rank-server" and args.rank == 1
    else:
        assert not ranks


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("consistency=xsp", "consistency"),
        ("shards.replicas=0", "replicas"),
        ("tls.enabled=true", "secretName"),
        ("shards.port=70000", "port"),
        ("shards.unknownKey=1", "unknownKey"),
    ],
)
def test_schema_refuses_bad_values(setting: str, complaint: str) -> None:
    result = helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every StatefulSet and Job."""
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objs
        if o["kind"] in ("StatefulSet", "Job")
    ]


def shard_set(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [
        s
        for s in by_kind(objs, "StatefulSet")
        if s["spec"]["template"]["spec"]["containers"][0]["name"] == "shard"
    ]
    return sts


def env_of(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's literal environment as the kubelet builds it for pod ``pod_name``:
    ``$(VAR)`` references to earlier entries expanded, fieldRef metadata.name = pod name."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            value = e["value"]
            for name, known in out.items():
                value = value.replace(f"$({name})", known)
            out[e["name"]] = value
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out[e["name"]] = pod_name
    return out


def probe_argv(probe: dict[str, Any]) -> list[str]:
    cmd = probe["exec"]["command"]
    assert cmd[:2] == ["paramserver", "health"], cmd
    return list(cmd[1:])


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_metrics_are_reachable_at_the_pod_address_with_their_auth_and_tls(values: Path) -> None:
    """The metrics endpoint binds a non-loopback interface inside the pod (the Service's
    metrics port forwards to the pod address), and its token and certificate come from the
    Secrets the values name, through the flags `paramserver serve` reads."""
    import ipaddress

    from paramserver.cli.main import build_parser

    v = values_of(values)["shards"]
    objs = render(values)
    sts = shard_set(objs)
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    f = flags(c["args"])
    if not v["metricsPort"]:
        assert not {k for k in f if k.startswith("metrics-")}
        return
    host = f["metrics-host"]
    assert host == v["metricsHost"]
    assert host == "0.0.0.0" or not ipaddress.ip_address(host).is_loopback
    args = build_parser().parse_args([a.replace("$(SHARD_INDEX)", "0") for a in c["args"]])
    assert (args.metrics_port, args.metrics_host) == (v["metricsPort"], host)
    (port,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == v["metricsPort"]
    svc = {o["metadata"]["name"]: o for o in by_kind(objs, "Service")}[sts["spec"]["serviceName"]]
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "metrics"]
    assert svc_port["targetPort"] == "metrics" and svc_port["port"] == v["metricsPort"]

    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {vol["name"]: vol["secret"] for vol in pod["volumes"] if "secret" in vol}

    def secret_file(path: str) -> tuple[str, str]:
        """(Secret name, key) of the file the container sees at ``path``."""
        for name, mount in mounts.items():
            if path.startswith(mount + "/") and name in secrets:
                rel = path[len(mount) + 1 :]
                items = {i["path"]: i["key"] for i in secrets[name].get("items", [])}
                return secrets[name]["secretName"], items.get(rel, rel)
        raise AssertionError(f"{path} is on no Secret volume")

    if v["metricsAuth"]["enabled"]:
        assert secret_file(args.metrics_token_file) == (
            v["metricsAuth"]["secretName"],
            "metrics-token",
        )
    else:
        assert args.metrics_token_file is None
    if v["metricsTls"]["enabled"]:
        name = v["metricsTls"]["secretName"]
        assert secret_file(args.metrics_tls_cert) == (name, "tls.crt")
        assert secret_file(args.metrics_tls_key) == (name, "tls.key")
    else:
        assert args.metrics_tls_cert is None and args.metrics_tls_key is None


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_probes_have_timeouts_and_check_each_pods_own_tls_name(
    values: Path, tmp_path: Path
) -> None:
    """Every probe states its timeout, period and failure threshold (the values'); an exec
    probe's `paramserver health` gives up before the probe's timeout; with TLS each pod's
    probe checks the certificate against that pod's own DNS name (built by the real client
    settings from the rendered environment), never shard 0's."""
    from paramserver.cli.main import build_parser
    from paramserver.security.tls import client_security_from_args
    from tests.harness.pki import make_pki, make_tokens

    all_values = values_of(values)
    tls = all_values["tls"]["enabled"]
    objs = render(values)
    sts = shard_set(objs)
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    timing = all_values["shards"]["probes"]
    for kind in ("readiness", "liveness", "startup"):
        probe = c[f"{kind}Probe"]
        assert probe["timeoutSeconds"] == timing["timeoutS"]
        assert probe["periodSeconds"] == timing[kind]["periodS"]
        assert probe["failureThreshold"] == timing[kind]["failureThreshold"]
    ranks = [s for s in by_kind(objs, "StatefulSet") if s is not sts]
    for r in ranks:
        (rc,) = r["spec"]["template"]["spec"]["containers"]
        for kind in ("readiness", "liveness"):
            probe = rc[f"{kind}Probe"]
            assert probe["timeoutSeconds"] == all_values["rankServers"]["probeTimeoutS"]
            assert probe["periodSeconds"] > 0 and probe["failureThreshold"] > 0

    pki, tokens = make_pki(tmp_path / "pki"), make_tokens(tmp_path / "tokens")
    files = {
        "/etc/paramserver/tls/ca.crt": pki.ca,
        "/etc/paramserver/tls/tls.crt": pki.client_cert,
        "/etc/paramserver/tls/tls.key": pki.client_key,
        "/etc/paramserver/auth/worker-token": str(Path(tokens.path).with_name("worker")),
    }
    Path(files["/etc/paramserver/auth/worker-token"]).write_text(tokens.worker + "\n")
    for stateful in [sts, *ranks]:
        (container,) = stateful["spec"]["template"]["spec"]["containers"]
        service = stateful["spec"]["serviceName"]
        for i in range(stateful["spec"]["replicas"]):
            pod_name = f"{stateful['metadata']['name']}-{i}"
            own_name = f"{pod_name}.{service}.{NAMESPACE}.svc.{all_values['clusterDomain']}"
            env = env_of(container, pod_name)
            for kind in ("readiness", "liveness", "startup"):
                probe = container.get(f"{kind}Probe")
                if probe is None:
                    continue
                if not tls:
                    assert "grpc" in probe and "exec" not in probe
                    assert "PARAMSERVER_TLS_SERVER_NAME" not in env
                    continue
                argv = [
                    f"{a.split('=', 1)[0]}={files[a.split('=', 1)[1]]}"
                    if "=" in a and a.split("=", 1)[1] in files
                    else a
                    for a in probe_argv(probe)
                ]
                args = build_parser().parse_args(argv)
                assert args.timeout_s < probe["timeoutSeconds"]
                assert args.tls_server_name is None  # from the pod's environment
                security = client_security_from_args(args, env)
                assert security is not None and security.tls_server_name == own_name


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_secrets_are_mounted_owner_read_only(values: Path) -> None:
    """Every Secret volume of every pod is mounted 0400 (kubelet adds group read for the pod's
    fsGroup, its own group), read-only."""
    objs = render(values)
    seen = 0
    for name, spec in pod_specs(objs):
        secret_volumes = {vol["name"] for vol in spec.get("volumes", []) if "secret" in vol}
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                assert vol["secret"].get("defaultMode") == 0o400, (name, vol)
                seen += 1
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            for m in c.get("volumeMounts", []):
                if m["name"] in secret_volumes:
                    assert m.get("readOnly") is True, (name, m)
    v = values_of(values)
    uses_secrets = (
        v["tls"]["enabled"]
        or v["auth"]["enabled"]
        or (
            v["shards"]["metricsPort"]
            and (v["shards"]["metricsAuth"]["enabled"] or v["shards"]["metricsTls"]["enabled"])
        )
    )
    assert (seen > 0) == bool(uses_secrets)


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_shard_pods_spread_over_nodes(values: Path) -> None:
    """Pod anti-affinity over the values' topology key, selecting exactly the shard pods:
    required (hard), preferred with the top weight (soft), or none (off)."""
    v = values_of(values)["shards"]
    pod = shard_set(render(values))["spec"]["template"]
    affinity = pod["spec"].get("affinity")
    if v["spread"] == "off" and not v["affinity"]:
        assert affinity is None
        return
    anti = affinity["podAntiAffinity"]
    if v["spread"] == "hard":
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
    else:
        (weighted,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        assert weighted["weight"] == 100
        term = weighted["podAffinityTerm"]
    assert term["topologyKey"] == v["spreadTopologyKey"]
    selector = term["labelSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert selector["app.kubernetes.io/component"] == "shard"


def test_an_explicit_affinity_replaces_the_spread() -> None:
    sts = shard_set(render(None, "--set", "shards.affinity.nodeAffinity.x=1"))
    assert sts["spec"]["template"]["spec"]["affinity"] == {"nodeAffinity": {"x": 1}}


def test_the_shards_outlive_the_worker_job() -> None:
    """Chosen on purpose: the shards keep serving the trained model after the worker Job ends
    (until `helm uninstall`). Nothing in the chart ties them to the Job: no owner reference, no
    hook that deletes or scales them, and the Job's pods do not share their labels."""
    objs = render(None)
    sts = shard_set(objs)
    (job,) = by_kind(objs, "Job")
    assert "ownerReferences" not in sts["metadata"]
    for obj in objs:
        assert not any(
            k.startswith("helm.sh/hook") for k in obj["metadata"].get("annotations", {})
        ), obj["metadata"]["name"]
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    assert not sts["spec"]["selector"]["matchLabels"].items() <= job_labels.items()
    assert "keep serving" in (CHART / "values.yaml").read_text()


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_a_script_worker_gets_what_paramserver_run_gives_it(values: Path, tmp_path: Path) -> None:
    """With workers.command, each pod's environment (as the kubelet builds it) read by the
    real readers (``WorkerEnv.from_env``, ``ClientSecurity.from_env``) names that pod's index,
    the job's size, a stable name, every shard in order, ``replace``, and the TLS and token
    files of the Secrets the values name; without it the container has none of them."""
    from paramserver.security.tls import ClientSecurity
    from paramserver.worker_client import WorkerEnv
    from tests.harness.pki import make_pki, make_tokens

    v = values_of(values)
    objs = render(values)
    if not v["workers"]["enabled"]:
        return
    (job,) = by_kind(objs, "Job")
    pod = job["spec"]["template"]["spec"]
    (w,) = pod["containers"]
    names = {e["name"] for e in w["env"]}
    if not v["workers"]["command"]:
        assert not {n for n in names if n.startswith("PARAMSERVER_")} and "NUM_WORKERS" not in names
        return
    sts = shard_set(objs)
    shard_svc, port = sts["spec"]["serviceName"], v["shards"]["port"]
    shards = [
        f"{sts['metadata']['name']}-{i}.{shard_svc}.{NAMESPACE}.svc.{v['clusterDomain']}:{port}"
        for i in range(v["shards"]["replicas"])
    ]
    mounts = {m["name"]: m["mountPath"] for m in w["volumeMounts"]}
    secrets = {
        vol["name"]: vol["secret"]["secretName"] for vol in pod["volumes"] if "secret" in vol
    }
    pki, tokens = make_pki(tmp_path / "pki"), make_tokens(tmp_path / "tokens")
    local = {  # (Secret, key) -> a real file standing in for it
        (v["tls"]["secretName"], "ca.crt"): pki.ca,
        (v["tls"]["secretName"], "tls.crt"): pki.client_cert,
        (v["tls"]["secretName"], "tls.key"): pki.client_key,
        (v["auth"]["secretName"], "worker-token"): tokens.worker_file,
    }

    def stand_in(path: str) -> str:
        for name, mount in mounts.items():
            if path.startswith(mount + "/") and name in secrets:
                return local[(secrets[name], path[len(mount) + 1 :])]
        raise AssertionError(f"{path} is on no Secret volume")

    for i in range(v["workers"]["replicas"]):
        pod_env = env_of({"env": [{"name": "WORKER_INDEX", "value": str(i)}, *w["env"]]}, "p")
        worker = WorkerEnv.from_env(pod_env)
        assert (worker.worker_index, worker.num_workers) == (i, v["workers"]["replicas"])
        assert worker.worker_name == f"worker-{i}" and worker.replace
        assert worker.address == shards[0] and list(worker.shard_addresses) == shards
        for extra in v["workers"]["env"]:
            assert pod_env[extra["name"]] == extra["value"]
        files = {k: stand_in(val) for k, val in pod_env.items() if val.startswith("/etc/")}
        security = ClientSecurity.from_env({**pod_env, **files})
        assert (security.tls_ca is not None) == v["tls"]["enabled"]
        assert (security.tls_cert is not None) == (v["tls"]["enabled"] and v["tls"]["mutual"])
        assert security.token == (tokens.worker if v["auth"]["enabled"] else None)
