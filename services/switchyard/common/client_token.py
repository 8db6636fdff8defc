"""The bearer token a client command sends to a stack with ``orchestrator.auth`` on.

One rule for every command that calls a running stack (``switchyard run``,
``switchyard profile``, ``switchyard bench run``, ``switchyard bench http``, the locustfile):
the token is the value of the environment variable ``--token-env`` names
(default ``SWITCHYARD_AUTH_TOKEN``; unset or empty: no token), never a value on
the command line. ``--token-file FILE`` (the file holding the token, surrounding
whitespace dropped) takes its place where a file is handier; given, it wins over
the variable. The token goes out as ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from switchyard.common import envs
from switchyard.common.untrusted import undecodable_byte

TOKEN_ENV = "SWITCHYARD_AUTH_TOKEN"
"""The variable ``switchyard run`` reads its token from (its ``--token-env`` default)."""


class TokenError(ValueError):
    """The token file cannot be read or holds no single token (the message names the flag or variable)."""


def add_token_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--token-file`` and ``--token-env`` (see the module docstring) on ``parser``."""
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the bearer token to send to a stack with orchestrator.auth on "
                        "(wins over --token-env)")
    parser.add_argument("--token-env", metavar="NAME", default=TOKEN_ENV,
                        help=f"variable holding the bearer token, as switchyard run reads it (default {TOKEN_ENV}; "
                        "unset or empty: no token; never given on the command line)")


def _one_token(text: str, where: str) -> str:
    token = text.strip()
    if not token:
        raise TokenError(f"{where}: expected a bearer token, found nothing")
    if (byte := undecodable_byte(token)) is not None:  # the environment's bytes that are not UTF-8
        raise TokenError(f"{where}: expected a bearer token of ASCII characters (byte 0x{byte:02X} is not UTF-8)")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise TokenError(f"{where}: expected one bearer token (no spaces, line breaks or control characters)")
    if not token.isascii():  # gRPC metadata values are ASCII: grpc refused it as INTERNAL "Invalid metadata"
        raise TokenError(f"{where}: expected a bearer token of ASCII characters (gRPC metadata and HTTP headers "
                         "carry ASCII; a server's token file holds such tokens)")
    return token


def bearer_token(token_file: str | None, token_env: str = TOKEN_ENV) -> str | None:
    """The token to send: ``token_file``'s contents when given, else the variable ``token_env``'s value.

    Returns:
        The token, or None when no file is given and the variable is unset or empty.

    Raises:
        TokenError: the file cannot be read, is empty or holds more than one word; or the variable holds
            more than one word. The message names ``--token-file FILE`` or the variable, never the token.
    """
    if token_file:
        try:
            text = Path(token_file).read_text(encoding="utf-8-sig")  # an editor's BOM is no part of it
        except UnicodeDecodeError:  # it read "cannot read it (UnicodeDecodeError)"; as auth.tokens_file's: no bytes
            raise TokenError(f"--token-file {token_file}: expected UTF-8 text (a byte of it is not UTF-8)") from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise TokenError(f"--token-file {token_file}: cannot read it ({reason})") from None
        return _one_token(text, f"--token-file {token_file}")
    value = envs.read_secret(token_env) if token_env else None
    return _one_token(value, f"--token-env: variable {token_env}") if value else None


def authorization(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or no header for no token."""
    return {"Authorization": f"Bearer {token}"} if token else {}
