"""Logging set-up shared by the CLI and the services."""

from __future__ import annotations

import logging

from switchyard.common import envs


# Libraries that log every request or their start-up probing at INFO: one line per upstream call
# (httpx) or per failed CPU-feature import (faiss) buries Switchyard's own lines.
QUIET_LIBRARIES = ("httpx", "httpcore", "faiss.loader")


def setup_logging(service: str = "switchyard") -> None:
    """One line per record: time, level, service, logger, message. Chatty libraries log from WARNING
    (:data:`QUIET_LIBRARIES`) unless SWITCHYARD_LOG_LEVEL is DEBUG."""
    level = envs.SWITCHYARD_LOG_LEVEL.get()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    if level != "DEBUG":
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
