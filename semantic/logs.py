"""loguru set-up: readable lines on a terminal, or JSON lines; request and agent ids on each."""

from __future__ import annotations

import json
import sys
from typing import Any

from loguru import logger

from semantic.config import LoggingSection
from semantic.protocols.observe import add_request_context

HUMAN_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "{extra[ids]}<level>{message}</level>"
)


def _json_line(message: Any) -> None:
    record = message.record
    line = {
        "time": record["time"].isoformat(),
        "level": record["level"].name,
        "message": record["message"],
        "logger": record["name"],
        **{k: v for k, v in record["extra"].items() if k != "ids"},
    }
    if record["exception"] is not None:
        line["exception"] = str(record["exception"].value)
    sys.stderr.write(json.dumps(line, default=str) + "\n")
    sys.stderr.flush()


def _with_ids(record: Any) -> None:
    add_request_context(record)
    extra = record["extra"]
    ids = [f"{k}={extra[k]}" for k in ("request_id", "agent_id") if extra.get(k)]
    extra["ids"] = f"[{' '.join(ids)}] " if ids else ""


def configure_logging(settings: LoggingSection) -> None:
    logger.remove()
    logger.configure(patcher=_with_ids)
    if settings.format == "json":
        logger.add(_json_line, level=settings.level, format="{message}")
    else:
        logger.add(sys.stderr, level=settings.level, format=HUMAN_FORMAT, colorize=sys.stderr.isatty())
