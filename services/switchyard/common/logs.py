"""Logging set-up shared by the CLI and the services."""

from __future__ import annotations

import logging

from switchyard.common import envs


def setup_logging(service: str = "switchyard") -> None:
    """One line per record: time, level, service, logger, message."""
    logging.basicConfig(
        level=envs.SWITCHYARD_LOG_LEVEL.get(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
