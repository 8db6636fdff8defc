"""docs/configuration.md is what ``switchyard config reference`` writes, and it covers every key."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from switchyard.cli import main as cli_main
from switchyard.common.config import SECTIONS
from switchyard.common.config.loader import ENV_KEYS, ENV_SPREAD, FORMER_NAMES, REMOVED_KEYS, _env_overrides
from switchyard.common.config.reference import render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def test_the_committed_reference_is_what_the_generator_writes():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: run PYTHONPATH=services python -m switchyard.cli config reference "
        "--write docs/configuration.md"
    )


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("admission_score_limit", "high_load_threshold", 1))
    assert cli_main(["config", "reference", "--check", str(stale)]) == 1
    assert "differs from the generated reference" in capsys.readouterr().err
    assert cli_main(["config", "reference", "--write", str(stale)]) == 0
    assert cli_main(["config", "reference", "--check", str(stale)]) == 0


def _keys(model, prefix=""):
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _keys(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_key_its_former_names_and_the_removed_keys_are_in_the_reference():
    text = render()
    for name, section in SECTIONS.items():
        prefix = "" if not section.keys or section.file.endswith(".toml") else ".".join(section.keys) + "."
        for key in _keys(section.model):
            assert f"| `{prefix}{key}` |" in text, f"{name}: {prefix}{key}"
    for renames in FORMER_NAMES.values():
        for old in renames:
            assert f"`{old}`" in text
    for removed in REMOVED_KEYS.values():
        for key in removed:
            assert f"| `{key}` |" in text
    for variable, _, _ in ENV_KEYS:
        assert f"`{variable.name}`" in text
    for name in ENV_SPREAD:
        assert f"`{name}`" in text


def test_the_variables_that_set_several_keys_set_the_keys_the_reference_names(monkeypatch):
    values = {"SWITCHYARD_DRAM_ADDR": "10.0.0.1:6380", "SWITCHYARD_TLS_DIR": "/etc/tls",
              "SWITCHYARD_AUTH_TOKENS_FILE": "/etc/tokens"}
    assert set(values) == set(ENV_SPREAD)
    for variable, _, _ in ENV_KEYS:
        monkeypatch.delenv(variable.name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
        set_keys = set(_env_overrides(set(SECTIONS)))
        monkeypatch.delenv(name)
        assert set_keys == {f"{section}.{key}" for section, key in ENV_SPREAD[name]}, name
