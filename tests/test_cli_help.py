"""Every command's --help is plain text: no reStructuredText or Markdown backticks, no roles."""

from __future__ import annotations

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
