"""The API key: read from the variable named by ``model_gateway.api_key_env``, checked, described safely."""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.common import envs
from switchyard.gateway.errors import UpstreamAuthError


@dataclass(frozen=True)
class ApiKey:
    """The key and the variable it came from. ``repr`` and ``str`` never show the value."""

    env: str
    value: str | None

    def __repr__(self) -> str:
        return f"ApiKey(env={self.env!r}, {describe_value(self.value)})"

    __str__ = __repr__

    @property
    def present(self) -> bool:
        return bool(self.value)

    @property
    def has_whitespace(self) -> bool:
        return self.value is not None and any(ch.isspace() for ch in self.value)

    def describe(self) -> str:
        """``NAME (length 37, trailing whitespace: '\\n')``: safe to log and show."""
        return f"{self.env} ({describe_value(self.value)})"

    def problem(self) -> str | None:
        """What is wrong with the key and how to fix it, or None when it looks usable."""
        if self.value is None:
            return f"{self.env} is not set; export {self.env}=<your key>"
        if self.value == "":
            return f"{self.env} is set but empty; export {self.env}=<your key>"
        if self.has_whitespace:
            return (
                f"{self.describe()} contains whitespace, usually a newline pasted with the key or "
                f"left by `echo` into a file; set it again without it, e.g. "
                f'export {self.env}="$(printf %s "${self.env}" | tr -d "[:space:]")"'
            )
        return None


def describe_value(value: str | None) -> str:
    """Length and whitespace of a secret, never its characters."""
    if value is None:
        return "not set"
    spots = []
    if value != value.lstrip():
        spots.append(f"leading {_ws(value[: len(value) - len(value.lstrip())])}")
    if value != value.rstrip():
        spots.append(f"trailing {_ws(value[len(value.rstrip()) :])}")
    inner = value.strip()
    if any(ch.isspace() for ch in inner):
        spots.append("inner whitespace")
    ws = "whitespace: " + ", ".join(spots) if spots else "no whitespace"
    return f"length {len(value)}, {ws}"


def _ws(chars: str) -> str:
    return repr(chars)


def load_api_key(env_name: str) -> ApiKey:
    """The key held by ``env_name`` (unchecked; see :meth:`ApiKey.problem`)."""
    return ApiKey(env_name, envs.read_secret(env_name))


def require_usable(key: ApiKey, *, required: bool) -> str | None:
    """The value to send as the bearer token, or None to send no Authorization header.

    Raises:
        UpstreamAuthError: the key has whitespace, or it is missing/empty while ``required``.
    """
    problem = key.problem()
    if problem is None:
        return key.value
    if not required and not key.present:
        return None
    if not key.present:  # a local server (vLLM, Ollama, transformers serve) usually takes no key at all
        problem += (f", or for a model server that takes no key set model_gateway.api_key_required to false "
                    f"({envs.SWITCHYARD_UPSTREAM_API_KEY_REQUIRED.name}=false)")
    raise UpstreamAuthError(f"model gateway API key unusable: {problem}")


NO_KEY = ApiKey(env="the variable model_gateway.api_key_env names", value=None)
"""No key: what a decoder outside a call (a test, a replay) redacts with and names."""
