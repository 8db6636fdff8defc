"""`switchyard profile`'s bearer token: SWITCHYARD_AUTH_TOKEN as `switchyard run` reads it, or --token-file,
against a real metrics port whose /debug/pprof/profile checks real bearer tokens (tests/test_profiling.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from test_profiling import profiled_service

from switchyard.common.auth import BearerTokens
from switchyard.common.config import AuthConfig
from switchyard_harness import cpu_profile

pytestmark = pytest.mark.no_gpu


def profile_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "switchyard.cli", "profile", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("contents", [None, "", "two words\n"])
def test_a_token_file_that_cannot_be_used_is_a_usage_error_naming_the_flag(tmp_path, contents, capsys):
    from switchyard import cli

    path = tmp_path / "token"
    if contents is not None:
        path.write_text(contents)
    try:  # in this process (an interpreter's start per case cost seconds): switchyard profile as the CLI runs it
        code = cli.main(["profile", "orchestrator", "--seconds", "1", "--token-file", str(path),
                         "--up-file", str(tmp_path / "no")])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"switchyard profile: error: --token-file {path}: " in err and "Traceback" not in err
    assert ("cannot read it" if contents is None else "expected") in err
    assert "two words" not in err  # the file's contents are never echoed


async def test_the_token_comes_from_switchyard_auth_token_as_switchyard_run_reads_it(tmp_path, monkeypatch, capsys):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("tok-ops-1\n")
    tokens = BearerTokens(AuthConfig(enabled=True, tokens_file=str(tokens_file), tokens_env=""))
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKEN", raising=False)
    async with profiled_service(tokens=tokens) as base:
        address = base.removeprefix("http://")

        def profile(*extra: str) -> int:
            return cpu_profile.main([address, "--seconds", "0.3", "--top", "3", *extra])

        assert await asyncio.to_thread(profile) == 1  # no token: 401, and the hint says where one goes
        assert "answered 401" in capsys.readouterr().err
        monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "tok-ops-1")
        assert await asyncio.to_thread(profile) == 0
        assert "GC pauses:" in capsys.readouterr().out
        monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "tok-wrong")
        monkeypatch.setenv("OPS_TOKEN", "tok-ops-1")
        assert await asyncio.to_thread(profile, "--token-env", "OPS_TOKEN") == 0  # the variable --token-env names
        capsys.readouterr()
        token_file = tmp_path / "token"
        token_file.write_text("tok-ops-1\n")
        assert await asyncio.to_thread(profile, "--token-file", str(token_file)) == 0  # the file wins over the variable
        capsys.readouterr()
        monkeypatch.delenv("SWITCHYARD_AUTH_TOKEN")
        assert await asyncio.to_thread(profile) == 1
        err = capsys.readouterr().err
        assert "set SWITCHYARD_AUTH_TOKEN (or pass --token-file FILE)" in err


def test_the_help_names_the_variable():
    run = profile_cli("--help")
    assert run.returncode == 0 and "SWITCHYARD_AUTH_TOKEN" in run.stdout and "--token-file" in run.stdout


@pytest.mark.parametrize("output", ["DIR", "FILE/profile.pb.gz", "/proc/profile.pb.gz"])
def test_an_output_that_cannot_be_written_exits_2_before_profiling(output, tmp_path, capsys):
    """A directory, a file where a folder should be, a file system that refuses new files: found before the
    profile's window, not with a traceback after it."""
    from switchyard_harness import cpu_profile

    (tmp_path / "FILE").write_text("")
    with pytest.raises(SystemExit) as caught:
        cpu_profile.main(["dispatcher", "--seconds", "1", "--output",
                          output.replace("DIR", str(tmp_path)).replace("FILE", str(tmp_path / "FILE"))])
    assert caught.value.code == 2 and "--output: expected a file that can be written" in capsys.readouterr().err


async def test_seconds_past_the_services_maximum_is_a_usage_error(capsys):
    """The command takes up to 3600 s; a service whose server.cpu_profile_max_s is lower answers 400: a bad
    argument (exit 2), not a failure to reach it (exit 1)."""
    async with profiled_service() as base:  # its maximum: 60 s
        code = await asyncio.to_thread(cpu_profile.main, [base.removeprefix("http://"), "--seconds", "61"])
    assert code == 2 and "answered 400" in capsys.readouterr().err
