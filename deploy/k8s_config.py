"""Write the container config folder from the repository's config/.

Containers use the same files as a local run, with the few values a container
needs changed (``OVERRIDES``): listen on all interfaces, reach the other
services by their Service names, read the index baked into the retrieval image.
Every other file is copied unchanged.

    python deploy/k8s_config.py                    # deploy/k8s/base/config/, for the ConfigMap
    python deploy/k8s_config.py --out /etc/switchyard   # what the image builds do

The output is generated, never committed, so it cannot drift from config/:
the images run this at build time, and ``kubectl apply -k`` needs it run first
(kustomize reads generator files only from inside the kustomization's folder).

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


def apply_overrides(data: dict, overrides: dict[str, object], filename: str) -> dict:
    """``data`` with each dotted key replaced (in place; returned for convenience).

    Raises:
        KeyError: a dotted key is not in ``data`` (the source file changed shape).
    """
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
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


def write(out: Path, source: Path = SOURCE) -> list[Path]:
    """Write every file of :data:`FILES` into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename in FILES:
        path = out / filename
        path.write_text(render(filename, source), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="config folder to read (default: config/)")
    parser.add_argument("--out", type=Path, default=TARGET, help="folder to write (default: deploy/k8s/base/config/)")
    args = parser.parse_args(argv)
    for path in write(args.out, args.source):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
