"""Every command's --help is plain text: no reStructuredText or Markdown backticks, no roles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from switchyard.cli import COMMANDS
from switchyard.cli import main as cli_main
from switchyard.common.cli_text import plain

HELPS = [[name, "--help"] for name in COMMANDS] + [
    ["bench", sub, "--help"] for sub in ("run", "compare", "sched", "isolation", "retrieval")
] + [["bench", "--help"], ["--help"]]


@pytest.mark.parametrize("argv", HELPS, ids=lambda argv: " ".join(argv))
def test_help_has_no_markup(argv, capsys):
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse exits after printing help
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0 and out.strip()
    assert "`" not in out and ":mod:" not in out and ":func:" not in out and "**" not in out, out


def test_plain_keeps_words_and_lines():
    text = "Use ``switchyard index`` (:func:`switchyard.retrieval.indexer.main`),\n**not** `make`::\n"
    assert plain(text) == "Use switchyard index (switchyard.retrieval.indexer.main),\nnot make:\n"


@pytest.mark.parametrize("argv", [["bench", "--help"], ["--help"], ["config", "reference"]])
def test_a_reader_that_went_away_ends_the_command_quietly(argv):
    """``switchyard ... | head -1``: the pipe closed before the command wrote, exit 0 and no traceback (as
    Unix tools do), whichever command it is."""
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


def test_no_command_is_a_usage_error(capsys):
    assert cli_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: switchyard COMMAND")


@pytest.mark.parametrize(("value", "parsed"), [("core", 1), ("Batch", 3), (" NORMAL ", 2)])
def test_run_takes_a_priority_by_the_orchestrators_rule(value, parsed):
    from switchyard.api import agent_pb2
    from switchyard.client import _priority

    assert _priority(value) == parsed == {"core": agent_pb2.CORE, "batch": agent_pb2.BATCH,
                                          "normal": agent_pb2.NORMAL}[value.strip().lower()]


def test_run_names_a_wrong_priority_as_given(capsys):
    with pytest.raises(SystemExit):
        cli_main(["run", "--priority", "urgent", "hello"])
    assert "argument --priority: expected core, normal or batch (got 'urgent')" in capsys.readouterr().err


def test_serve_refuses_a_port_file_it_cannot_write_before_the_service_starts(tmp_path, capsys):
    """It bound its ports, started, and then failed with a bare "[Errno 20] Not a directory" naming no option."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    with pytest.raises(SystemExit) as refused:
        cli_main(["serve", "retrieval", "--port", "0", "--metrics-port", "0", "--port-file", str(a_file / "ports")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"--port-file: expected a path in a folder this user can write, got {str(a_file / 'ports')!r}" in err, err
    with pytest.raises(SystemExit) as refused:  # a folder at the path: it started, then failed renaming onto it
        cli_main(["serve", "retrieval", "--port", "0", "--metrics-port", "0", "--port-file", str(tmp_path)])
    assert refused.value.code == 2
    assert f"--port-file: expected a path in a folder this user can write, got {str(tmp_path)!r} ({tmp_path} is a " \
        "directory)" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "70000"], "--port 70000: key 'retrieval.port' has value 70000; expected: Input should be less than or "
                          "equal to 65535"),
    (["--port", "51880", "--metrics-port", "51880"], "--port 51880 and --metrics-port 51880: section 'retrieval': "
                                                     "retrieval.port and retrieval.metrics_port are both 51880"),
    (["--metrics-port", "9102"], None),  # retrieval.port's own number in the file: a clash, named below
])
def test_serve_names_the_option_a_refused_port_came_from(capfd, args, message):
    """The refusal read 'overrides: key 'retrieval.port' has value 70000': the option given was not named."""
    if message is None:
        from switchyard.common.config import load_config

        port = load_config("config", service="retrieval").retrieval.port
        args = ["--metrics-port", str(port)]
        message = (f"--metrics-port {port}: section 'retrieval': retrieval.port and retrieval.metrics_port are both "
                   f"{port}")
    assert cli_main(["serve", "retrieval", *args]) == 2
    err = capfd.readouterr().err
    assert f"switchyard serve retrieval: bad configuration:\n{message}" in err, err
    assert "overrides" not in err


def _sigint_as_a_terminal_gives_it() -> None:
    """In the child, before exec: SIGINT default and unblocked (a disposition set to ignore, and a blocked mask,
    are kept across exec; a handler is not)."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_command_with_status_130_and_no_traceback():
    """SIGINT while `switchyard profile` waits on an endpoint that never answers: exit 130, nothing on stderr but
    what the command said; bench run, bench http and profile printed a KeyboardInterrupt traceback."""
    import signal
    import socket
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "services"), str(root / "harness")])}
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the connection, never answers
        port = silent.getsockname()[1]
        # the command starts with SIGINT as a terminal's shell gives it (default, unblocked), whatever this
        # process inherited or a test before set: the suite started in the background has it ignored
        parent = signal.getsignal(signal.SIGINT)
        proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "profile", f"127.0.0.1:{port}",
                                 "--seconds", "30"], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_a_terminal_gives_it)
        try:
            silent.settimeout(60)
            connection, _ = silent.accept()  # the command is now waiting on its answer
            with connection:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err, f"SIGINT here: {parent}")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_python_dash_m_switchyard_is_the_switchyard_command():
    """``python -m switchyard`` runs the command as the console script does (an environment whose scripts folder
    is not on PATH): its usage, and a usage error's status 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ran = subprocess.run([sys.executable, "-m", "switchyard", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert ran.returncode == 0 and ran.stdout.startswith("usage: switchyard COMMAND"), ran.stderr
    wrong = subprocess.run([sys.executable, "-m", "switchyard", "nope"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert wrong.returncode == 2 and "unknown command 'nope'" in wrong.stderr
