"""Derive each image's requirement file from requirements.lock and pyproject extras.

requirements.lock is one flat lock for everything (all extras, dev tools). An
image should install only what its service needs, so this script walks the
dependency graph from the service's top-level requirements (pyproject
``dependencies`` plus the service's extras) through the installed packages'
metadata, evaluates markers for the image's Python, and pins every package in
the closure to its version in requirements.lock.

    python deploy/lock.py            # rewrite deploy/requirements/<service>.txt
    python deploy/lock.py --check    # exit 1 when a file is out of date

Run it with the project's virtual environment (the one built from
requirements.lock): package metadata comes from there.

Errors (LockError): a package in a closure that requirements.lock does not
pin, a pin that does not satisfy a dependent's specifier, or a pinned package
missing from this environment stops the script, naming the package, who needs
it and the specifier.

The CUDA build of torch (dispatcher) declares nvidia-* dependencies that the
CPU build installed here does not; they are exact pins in torch's own
metadata, so the dispatcher image resolves them at install time.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
OUT_DIR = ROOT / "deploy" / "requirements"


@dataclass(frozen=True)
class Image:
    """One service image: the pyproject extras it installs and its Python (major.minor.micro: markers
    such as redis-py's ``python_full_version < '3.11.3'`` compare the micro version)."""

    extras: tuple[str, ...]
    python: str


# Python versions match the base images in deploy/docker/: python:3.11.13-slim for the
# CPU services, the CUDA image's Ubuntu 24.04 system Python 3.12 (3.12.3) for the dispatcher.
IMAGES: dict[str, Image] = {
    "orchestrator": Image(extras=(), python="3.11.13"),
    "retrieval": Image(extras=("retrieval",), python="3.11.13"),
    "dispatcher": Image(extras=("dispatcher", "torch"), python="3.12.3"),
}


class LockError(Exception):
    """requirements.lock cannot satisfy an image's dependency closure."""


def read_lock(path: Path = LOCK) -> dict[str, tuple[str, str]]:
    """``{canonical name: (name as written, version)}`` for every ``name==version`` line."""
    pins: dict[str, tuple[str, str]] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise LockError(f"{path.name}: line {raw!r} is not an exact pin 'name==version'")
        pins[canonicalize_name(name)] = (name.strip(), version.strip())
    return pins


def top_level(image: Image, pyproject: Path = PYPROJECT) -> list[Requirement]:
    """The image's direct requirements: pyproject ``dependencies`` plus its extras."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"])
    for extra in image.extras:
        try:
            specs += project["optional-dependencies"][extra]
        except KeyError:
            raise LockError(f"pyproject.toml has no extra {extra!r}") from None
    return [Requirement(spec) for spec in specs]


def _environment(python: str) -> dict[str, str]:
    """PEP 508 marker environment of a Linux x86_64 CPython image."""
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


def closure(image: Image, pins: dict[str, tuple[str, str]]) -> dict[str, str]:
    """``{name as written in the lock: version}`` for every package the image needs.

    Raises:
        LockError: a needed package is not pinned, its pin breaks a specifier,
            or it is not installed in this environment.
    """
    env = _environment(image.python)
    needed: dict[str, str] = {}
    todo: list[tuple[Requirement, str]] = [(req, "pyproject.toml") for req in top_level(image)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, parent = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = canonicalize_name(req.name)
        if key not in pins:
            raise LockError(f"{req.name} (needed by {parent} as {str(req)!r}) is not pinned in requirements.lock")
        name, version = pins[key]
        if not req.specifier.contains(Version(version), prereleases=True):
            raise LockError(f"requirements.lock pins {name}=={version}, but {parent} needs {str(req)!r}")
        needed[name] = version
        state = (key, frozenset(req.extras))
        if state in seen:
            continue
        seen.add(state)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            raise LockError(
                f"{name}=={version} is pinned but not installed here, so its dependencies are unknown; "
                "install requirements.lock into this environment first"
            ) from None
        for spec in requires:
            child = Requirement(spec)
            if child.marker is not None and not any(
                child.marker.evaluate({**env, "extra": extra}) for extra in ("", *req.extras)
            ):
                continue
            child.marker = None
            todo.append((child, name))
    return needed


def render(service: str, pins: dict[str, tuple[str, str]] | None = None) -> str:
    """The text of ``deploy/requirements/<service>.txt``."""
    image = IMAGES[service]
    packages = closure(image, pins if pins is not None else read_lock())
    extras = f"[{','.join(image.extras)}]" if image.extras else "(no extras)"
    lines = [
        f"# {service} image: switchyard {extras} on Python {image.python}, pinned from requirements.lock.",
        "# Generated by deploy/lock.py; do not edit. Regenerate: python deploy/lock.py",
    ]
    lines += [f"{name}=={packages[name]}" for name in sorted(packages, key=str.lower)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a file differs instead of writing it")
    args = parser.parse_args(argv)
    pins = read_lock()
    stale = []
    for service in IMAGES:
        path = OUT_DIR / f"{service}.txt"
        text = render(service, pins)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run: python deploy/lock.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
