"""Write the container config folder from the repository's config/.

Containers use the same files as a local run, with the few values a container
needs changed (``OVERRIDES``): listen on all interfaces, reach the other
services by their Service names, read the index baked into the retrieval image.
Every other file is copied unchanged.

    python deploy/k8s_config.py                    # deploy/k8s/base/config/, for the ConfigMap, and the
                                                   # tls-auth component's switchyard.json
    python deploy/k8s_config.py --out /etc/switchyard   # what the image builds do

The output is generated, never committed, so it cannot drift from config/:
the images run this at build time, and ``kubectl apply -k`` needs it run first
(kustomize reads generator files only from inside the kustomization's folder).

The ``tls-auth`` component (``k8s/components/tls-auth/``) replaces the
ConfigMap's ``switchyard.json`` with the same file plus ``TLS_AUTH_OVERRIDES``:
TLS with client certificates on every hop and bearer tokens at the
orchestrator, read from the Secrets the component mounts, and the plain-text
health ports its probes ask.

Raises KeyError (naming the file and key) when config/ no longer has a key
that ``OVERRIDES`` replaces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "config"
TARGET = ROOT / "deploy" / "k8s" / "base" / "config"
TLS_AUTH_TARGET = ROOT / "deploy" / "k8s" / "components" / "tls-auth" / "config"
FILES = ("queue.json", "scheduler_config.json", "memory_policy.toml", "switchyard.json")

# Where the retrieval image's build step writes the default index.
INDEX_DIR = "/opt/switchyard/index"

# file -> {dotted key: container value}; Service names and ports from deploy/k8s/base/.
OVERRIDES: dict[str, dict[str, object]] = {
    "switchyard.json": {
        "server.host": "0.0.0.0",
        # dns:/// of the headless Services: round_robin over every ready pod.
        "orchestrator.retrieval_addr": "dns:///retrieval:50052",
        "orchestrator.dispatcher_addr": "dns:///dispatcher:50053",
        # replicas (HPA: 3 to 30) share one task store: Redis (redis.yaml), reached by SWITCHYARD_DRAM_ADDR
        "orchestrator.task_store.backend": "redis",
        "retrieval.index_dir": INDEX_DIR,
    },
}

# Where components/tls-auth mounts its Secrets: switchyard-tls (tls.crt, tls.key, ca.crt) in every
# service, switchyard-auth (tokens) in the orchestrator.
TLS_DIR = "/etc/switchyard-tls"
AUTH_DIR = "/etc/switchyard-auth"
# The plain-text health-only ports the component's probes ask (kubelet's grpc probes cannot speak TLS).
HEALTH_PORTS = {"orchestrator": 50061, "retrieval": 50062, "dispatcher": 50063}

# switchyard.json keys the tls-auth component adds on top of OVERRIDES.
TLS_AUTH_OVERRIDES: dict[str, object] = {
    "server.tls": {
        "enabled": True,
        "cert_file": f"{TLS_DIR}/tls.crt",
        "key_file": f"{TLS_DIR}/tls.key",
        "ca_file": f"{TLS_DIR}/ca.crt",
        # mTLS: every server asks for a client certificate signed by ca.crt, every channel presents tls.crt.
        "require_client_auth": True,
        # The orchestrator reaches each dispatcher pod by its IP address: the name checked instead.
        "server_name": "dispatcher",
    },
    "orchestrator.auth": {"enabled": True, "tokens_file": f"{AUTH_DIR}/tokens"},
    **{f"{name}.health_port": port for name, port in HEALTH_PORTS.items()},
}


def apply_overrides(data: dict, overrides: dict[str, object], filename: str, add: bool = False) -> dict:
    """``data`` with each dotted key replaced (in place; returned for convenience).

    With ``add``, a key that the file leaves at its default (absent) is added;
    its parent must still be there.

    Raises:
        KeyError: a dotted key (``add``: its parent) is not in ``data`` (the source file changed shape).
    """
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or (leaf not in node and not add):
            raise KeyError(f"config/{filename}: key {dotted!r} not found; update OVERRIDES in deploy/k8s_config.py")
        node[leaf] = value
    return data


def render(filename: str, source: Path = SOURCE) -> str:
    """The container version of ``<source>/<filename>``."""
    text = (source / filename).read_text(encoding="utf-8")
    if filename not in OVERRIDES:
        return text
    data = apply_overrides(json.loads(text), OVERRIDES[filename], filename)
    return json.dumps(data, indent=2) + "\n"


def render_tls_auth(source: Path = SOURCE) -> str:
    """The tls-auth component's ``switchyard.json``: the container version plus :data:`TLS_AUTH_OVERRIDES`."""
    data = apply_overrides(json.loads(render("switchyard.json", source)), TLS_AUTH_OVERRIDES, "switchyard.json",
                           add=True)
    return json.dumps(data, indent=2) + "\n"


def write(out: Path, source: Path = SOURCE) -> list[Path]:
    """Write every file of :data:`FILES` into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename in FILES:
        path = out / filename
        path.write_text(render(filename, source), encoding="utf-8")
        written.append(path)
    return written


def write_tls_auth(out: Path = TLS_AUTH_TARGET, source: Path = SOURCE) -> Path:
    """Write the tls-auth component's ``switchyard.json`` into ``out``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "switchyard.json"
    path.write_text(render_tls_auth(source), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="config folder to read (default: config/)")
    parser.add_argument("--out", type=Path, help="folder to write (default: deploy/k8s/base/config/, and the "
                        "tls-auth component's config/)")
    args = parser.parse_args(argv)
    written = write(args.out or TARGET, args.source)
    if args.out is None:
        written.append(write_tls_auth(TLS_AUTH_TARGET, args.source))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
