"""Reading the files: sections each service reads, former key names, environment overrides."""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from switchyard.common import envs
from switchyard.common.untrusted import duplicate_key
from switchyard.common.config.aggregate import SwitchyardConfig, _assemble
from switchyard.common.config.base import ConfigError, _describe, did_you_mean
from switchyard.common.config.gating import unread_section
from switchyard.common.config.dispatcher import DispatcherConfig
from switchyard.common.config.memory import DramTierConfig, HbmTierConfig, OssTierConfig
from switchyard.common.config.model_gateway import AdaptiveConcurrencyConfig
from switchyard.common.config.orchestrator import OrchestratorConfig
from switchyard.common.config.queues import InferenceQueueConfig
from switchyard.common.config.retrieval import RetrievalConfig
from switchyard.common.config.scheduler import SchedulerConfig
from switchyard.common.config.sections import ENGINE_SECTIONS, SECTIONS, SERVICE_SECTIONS, Section

# The loader's warnings keep the package's logger name.
log = logging.getLogger("switchyard.common.config")


# Keys renamed to say what the code does with them: former name -> current name, per section
# model. A former name still loads, with a warning naming the current one.
FORMER_NAMES: dict[type[BaseModel], dict[str, str]] = {
    SchedulerConfig: {"max_running_agents": "max_admitted_per_decision",
                      "preemption_grace_ms": "core_wait_before_preempt_ms",
                      "high_load_threshold": "admission_score_limit"},
    InferenceQueueConfig: {"workers": "max_batches_in_prefill"},
    HbmTierConfig: {"evict_threshold": "evict_first_below", "defrag_trigger_score": "defrag_below_score"},
    DramTierConfig: {"promote_threshold": "renew_ttl_threshold"},
    OssTierConfig: {"archive_interval_s": "archive_after_s", "archive_interval_sec": "archive_after_s"},
    OrchestratorConfig: {"task_table_size": "max_unfinished_submitted_tasks"},
    RetrievalConfig: {"top_k": "default_top_k"},
    AdaptiveConcurrencyConfig: {"tolerance": "ttft_tolerance"},
}

# Keys that no code reads any more: key -> what to do. They load with a warning, and are ignored.
REMOVED_KEYS: dict[type[BaseModel], dict[str, str]] = {
    SchedulerConfig: {"low_load_threshold": "nothing reads it (admission uses admission_score_limit); remove it"},
    DramTierConfig: {"backend": "the DRAM tier is always Redis; remove it"},
}


# Keys moved to another section: key -> its place now. A moved key is refused by name (its value would
# otherwise be ignored, or read in one service and not the other).
MOVED_KEYS: dict[type[BaseModel], dict[str, str]] = {
    OrchestratorConfig: {"default_max_tokens": "limits.default_max_tokens"},
    DispatcherConfig: {"default_max_tokens": "limits.default_max_tokens"},
}


def _old_unit_names(raw: dict[str, Any], model: type[BaseModel], where: str, notes: list[str]) -> dict[str, Any]:
    """``raw`` with keys under former names moved to their current fields (recursively).

    Former names are the ``*_sec`` spellings of ``*_s`` fields and the renames of
    ``FORMER_NAMES``; keys of ``REMOVED_KEYS`` are dropped. Each adds a note (logged as a
    warning by the loader).

    Raises:
        ConfigError: a former name and its current name are both present, or a key of ``MOVED_KEYS``.
    """
    out = dict(raw)
    renames = FORMER_NAMES.get(model, {})
    removed = REMOVED_KEYS.get(model, {})
    moved = MOVED_KEYS.get(model, {})
    for key, value in raw.items():
        field = model.model_fields.get(key)
        if key in moved:
            raise ConfigError(f"{where}{key}' moved to '{moved[key]}' (one default for every model call, read by "
                              f"both services); move it there")
        if key in removed:
            notes.append(f"{where}{key}' is no longer a setting: {removed[key]}")
            out.pop(key)
        elif key in renames or (key.endswith("_sec") and key[:-4] + "_s" in model.model_fields):
            new = renames.get(key) or key[:-4] + "_s"
            if new in raw:
                raise ConfigError(f"{where}{key}' is the former name of '{new}': give one of them, not both")
            same = "" if key in renames else " (same value, seconds)"
            notes.append(f"{where}{key}' is the former name of '{new}'{same}; rename it")
            out[new] = out.pop(key)
        elif field is not None and isinstance(value, dict):
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out[key] = _old_unit_names(value, annotation, f"{where}{key}.", notes)
    return out


class _Files:
    """Parsed config files of one folder, each read once and only when a section needs it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._parsed: dict[str, dict[str, Any]] = {}

    def table(self, section: Section) -> dict[str, Any]:
        """The raw table of ``section`` ({} when the file leaves it out: every key has a default).

        Raises:
            ConfigError: the file is missing or unparsable, or a table on the way is not one.
        """
        node: Any = self.parse(section.file)
        for depth, key in enumerate(section.keys):
            node = node.get(key, {})
            if not isinstance(node, dict):
                dotted = ".".join(section.keys[: depth + 1])
                raise ConfigError(f"{self.folder / section.file}: key '{dotted}' has value {node!r}; expected: a table")
        return node

    def parse(self, filename: str) -> dict[str, Any]:
        if filename not in self._parsed:
            self._parsed[filename] = _parse(self.folder / filename)
        return self._parsed[filename]


def _parse(path: Path) -> dict[str, Any]:
    if not path.is_file():
        found = "a folder is there, not a file" if path.is_dir() else "file not found"
        raise ConfigError(
            f"{path}: {found}; expected it beside the other config files "
            "(the repository's config/ folder has every file with its default values)"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM, as some editors save UTF-8, is no error
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper()}: {exc}") from None
    except OSError as exc:  # no permission: it was a PermissionError traceback, not a refusal naming the file
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc}); expected a file this user can read") \
            from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level has value {raw!r}; expected: an object")
    if path.suffix != ".toml" and (twice := duplicate_key(text)) is not None:  # TOML's parser refuses its own
        raise ConfigError(f"{path}: key '{twice}' is given twice; expected each key once (a JSON parser keeps the "
                          "last, unsaid)")
    return raw


def _unknown_tables(files: _Files, names: tuple[str, ...]) -> list[str]:
    """Typos among the table names of the files ``names`` come from (keys inside a table are the section's)."""
    problems = []
    for filename in dict.fromkeys(SECTIONS[n].file for n in names):
        tables = [s.keys for s in SECTIONS.values() if s.file == filename]
        if any(not keys for keys in tables):
            continue  # the whole file is one section, checked by its model
        try:
            raw = files.parse(filename)
        except ConfigError:
            continue  # reported by the sections
        known_top = {keys[0] for keys in tables}
        for key in raw:
            if key not in known_top:
                problems.append(f"{files.folder / filename}: key '{key}' has value {raw[key]!r}; "
                                f"expected: no such key (a typo?); the tables are {', '.join(sorted(known_top))}")
        for top in known_top:
            inner = [keys[1] for keys in tables if len(keys) > 1 and keys[0] == top]
            if inner and isinstance(raw.get(top), dict):
                for key in raw[top]:
                    if key not in inner:
                        problems.append(f"{files.folder / filename}: key '{top}.{key}' has value "
                                        f"{raw[top][key]!r}; expected: no such key (a typo?)"
                                        + did_you_mean(key, inner))
    return problems


def _read_section(files: _Files, name: str, notes: list[str]) -> BaseModel:
    section = SECTIONS[name]
    path = files.folder / section.file
    prefix = ".".join(section.keys)
    raw = _old_unit_names(files.table(section), section.model, f"{path}: key '{prefix}." if prefix else f"{path}: key '",
                          notes)
    try:
        return section.model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(str(path), exc, prefix=prefix, model=section.model)) from None


# Variables whose value replaces one key: (variable, section, key inside the section).
ENV_KEYS: tuple[tuple[envs.EnvVar[Any], str, str], ...] = (
    (envs.SWITCHYARD_ENGINE, "dispatcher", "engine"),
    (envs.SWITCHYARD_HOST, "server", "host"),
    (envs.SWITCHYARD_INDEX_DIR, "retrieval", "index_dir"),
    (envs.SWITCHYARD_RETRIEVAL_ADDR, "orchestrator", "retrieval_addr"),
    (envs.SWITCHYARD_DISPATCHER_ADDR, "orchestrator", "dispatcher_addr"),
    (envs.SWITCHYARD_TASK_STORE, "orchestrator", "task_store.backend"),
    (envs.SWITCHYARD_TASK_STORE_SQLITE_PATH, "orchestrator", "task_store.sqlite_path"),
    (envs.SWITCHYARD_UPSTREAM_BASE_URL, "upstream", "base_url"),
    (envs.SWITCHYARD_UPSTREAM_MODEL, "upstream", "default_model"),
    (envs.SWITCHYARD_UPSTREAM_FALLBACK_MODEL, "upstream", "fallback_model"),
    (envs.SWITCHYARD_UPSTREAM_API_KEY_REQUIRED, "upstream", "api_key_required"),
    (envs.SWITCHYARD_UPSTREAM_FORWARD_PRIORITY, "upstream", "forward_priority"),
    (envs.SWITCHYARD_TLS_CLIENT_AUTH, "server", "tls.require_client_auth"),
    (envs.SWITCHYARD_TLS_SERVER_NAME, "server", "tls.server_name"),
    *((envs.SWITCHYARD_HEALTH_PORT, name, "health_port") for name in ("orchestrator", "retrieval", "dispatcher")),
)

# Variables that set several keys from one value (applied by _env_overrides): variable -> (section, key)s.
ENV_SPREAD: dict[str, tuple[tuple[str, str], ...]] = {
    envs.SWITCHYARD_DRAM_ADDR.name: (("memory.dram", "host"), ("memory.dram", "port")),
    envs.SWITCHYARD_TLS_DIR.name: (("server", "tls.enabled"), ("server", "tls.cert_file"), ("server", "tls.key_file"),
                                   ("server", "tls.ca_file")),
    envs.SWITCHYARD_AUTH_TOKENS_FILE.name: (("orchestrator", "auth.enabled"), ("orchestrator", "auth.tokens_file")),
}


def _env_overrides(held: set[str]) -> dict[str, Any]:
    """Values the environment sets (:data:`ENV_KEYS`, :data:`ENV_SPREAD`), for the sections in ``held``."""
    out: dict[str, Any] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None and section in held:
            out[f"{section}.{key}"] = value

    for variable, section, key in ENV_KEYS:
        put(section, key, variable.get())
    if (addr := envs.SWITCHYARD_DRAM_ADDR.get()) is not None:
        host, _, port = addr.rpartition(":")
        put("memory.dram", "host", host)
        put("memory.dram", "port", int(port))
    if (tls_dir := envs.SWITCHYARD_TLS_DIR.get()) is not None:
        folder = tls_dir.rstrip("/")
        put("server", "tls.enabled", True)
        put("server", "tls.cert_file", f"{folder}/tls.crt")
        put("server", "tls.key_file", f"{folder}/tls.key")
        put("server", "tls.ca_file", f"{folder}/ca.crt")
    if (tokens_file := envs.SWITCHYARD_AUTH_TOKENS_FILE.get()) is not None:
        put("orchestrator", "auth.enabled", True)
        put("orchestrator", "auth.tokens_file", tokens_file)
    return out


def config_folder(config_dir: str | Path | None = None) -> Path:
    """The folder :func:`load_config` reads: ``config_dir``, else ``SWITCHYARD_CONFIG_DIR``, else ``config``."""
    return Path(config_dir if config_dir is not None else envs.SWITCHYARD_CONFIG_DIR.get())


def load_config(config_dir: str | Path | None = None, service: str | tuple[str, ...] | None = None) -> SwitchyardConfig:
    """Load and validate config files, then apply environment overrides.

    Args:
        config_dir: folder of the files; default ``SWITCHYARD_CONFIG_DIR`` or ``config``.
        service: ``orchestrator``, ``retrieval`` or ``dispatcher`` (or several): read and validate
            only the sections they read (:data:`SERVICE_SECTIONS`), so that a bad value elsewhere
            does not stop them; the others are left out. None: every section (tools, doctor).

    Raises:
        ConfigError: a file is missing or unparsable, or a value is invalid; the message names the
            file, the key, the value and what was expected (every problem at once).
        ValueError: an environment override is malformed (naming the variable).
    """
    folder = config_folder(config_dir)
    if not folder.is_dir():
        raise ConfigError(
            f"{folder.resolve()}: config folder not found; expected a folder holding queue.json and friends: run "
            "from the repository root (where config/ is), or name the folder with --config-dir or "
            f"{envs.SWITCHYARD_CONFIG_DIR.name}")
    readers = (service,) if isinstance(service, str) else service or ()
    if unknown := [name for name in readers if name not in SERVICE_SECTIONS]:
        raise ValueError(f"unknown service {unknown[0]!r}; expected one of {', '.join(SERVICE_SECTIONS)}")
    files = _Files(folder)
    notes: list[str] = []
    names = tuple(dict.fromkeys(n for r in readers for n in SERVICE_SECTIONS[r])) if readers else tuple(SECTIONS)
    sections, problems = _read_all(files, names, notes)
    if "dispatcher" in readers and "dispatcher" in sections:
        engine = envs.SWITCHYARD_ENGINE.get() or sections["dispatcher"].engine
        extra, more = _read_all(files, (ENGINE_SECTIONS[engine],), notes)
        sections.update(extra)
        problems += more
        names = (*names, ENGINE_SECTIONS[engine])
    problems += _unknown_tables(files, names)
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    for note in notes:
        log.warning("%s", note)
    reader = " and ".join(readers)
    held = {
        name: sections[name] if name in sections
        else unread_section(SECTIONS[name].model, name, reader, f"{SECTIONS[name].file} {SECTIONS[name].where()}")
        for name in SECTIONS
    }
    config = _assemble(held, str(folder), str(folder / "switchyard.json"))
    overrides = _env_overrides(set(sections))
    return config.with_overrides_from(overrides, _env_sources(), "environment")


def builtin_config() -> SwitchyardConfig:
    """The built-in defaults with the environment's overrides (:data:`ENV_KEYS`, :data:`ENV_SPREAD`) applied: the
    config of a client given an address and no config folder (``switchyard run --addr`` where no ``config/`` is).
    Such a client had taken the bare defaults, so ``SWITCHYARD_TLS_DIR`` (the documented way to point it at a TLS
    stack) was not read and it dialled plain text.

    Raises:
        ConfigError: an override's value is invalid, naming its variable.
        ValueError: an environment override is malformed (naming the variable).
    """
    return SwitchyardConfig().with_overrides_from(_env_overrides(set(SECTIONS)), _env_sources(), "environment")


def _env_sources() -> dict[str, str]:
    """Each key a variable of :data:`ENV_KEYS` or :data:`ENV_SPREAD` sets -> the variable as it is set
    (``environment variable SWITCHYARD_UPSTREAM_BASE_URL='http://x:99999/v1'``), for a refusal to name."""
    sources = {f"{section}.{key}": variable.name for variable, section, key in ENV_KEYS}
    sources |= {f"{section}.{key}": name for name, keys in ENV_SPREAD.items() for section, key in keys}
    return {key: f"environment variable {name}={envs.raw_value(name)!r}" for key, name in sources.items()}


def set_by_environment(section: str, key: str) -> str:
    """`` (set by environment variable NAME='value')`` where a variable of :data:`ENV_KEYS` or :data:`ENV_SPREAD`
    sets ``section``'s ``key`` now, else empty: for a refusal found after loading (a file the key names cannot be
    read) to name the variable the operator set, as a refusal at load does."""
    names = [variable.name for variable, s, k in ENV_KEYS if (s, k) == (section, key)]
    names += [name for name, keys in ENV_SPREAD.items() if (section, key) in keys]
    for name in names:
        if raw := envs.raw_value(name):
            return f" (set by environment variable {name}={raw!r})"
    return ""


def _read_all(files: _Files, names: tuple[str, ...], notes: list[str]) -> tuple[dict[str, BaseModel], list[str]]:
    sections: dict[str, BaseModel] = {}
    problems: list[str] = []
    for name in names:  # report every bad section at once, not the first only
        try:
            sections[name] = _read_section(files, name, notes)
        except ConfigError as exc:
            problems.append(str(exc))
    return sections, problems
