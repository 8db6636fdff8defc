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


def test_a_write_or_check_path_that_is_no_file_is_refused_naming_it_never_a_traceback(tmp_path, capsys):
    """A folder, a file where a folder should be, a missing or non-UTF-8 file: exit 2 (or 1, --check) naming
    the option and what is there; --write to a folder and --check of a non-UTF-8 file were tracebacks, and a
    missing file read 'differs'."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for args, code, words in (
        (["--write", str(tmp_path)], 2, f"--write: expected a file this user can write, got '{tmp_path}' "
                                        f"({tmp_path} is a directory)"),
        (["--write", str(blocker / "x.md")], 2, f"({blocker} is not a folder)"),
        (["--check", str(tmp_path)], 2, f"--check: expected the reference's file, got '{tmp_path}' (a directory)"),
        (["--check", str(tmp_path / "missing.md")], 1, "missing.md does not exist; run: switchyard config "
                                                        "reference --write"),
    ):
        try:
            status = cli_main(["config", "reference", *args])
        except SystemExit as exc:  # argparse's error: exit 2 with usage
            status = exc.code
        assert status == code, args
        assert words in capsys.readouterr().err, args
    binary = tmp_path / "binary.md"
    binary.write_bytes(b"\xc7\x00" + render().encode())
    assert cli_main(["config", "reference", "--check", str(binary)]) == 1
    assert "binary.md cannot be read as UTF-8 text" in capsys.readouterr().err
