"""loguru set-up: readable lines on a terminal, or JSON lines; request and agent ids on each."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loguru import logger

from semantic.protocols.observe import add_request_context
from semantic.protocols.settings import LoggingSection

HUMAN_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "{extra[ids]}<level>{message}</level>"
)


def _json_text(record: Any) -> str:
    line = {
        "time": record["time"].isoformat(),
        "level": record["level"].name,
        "message": record["message"],
        "logger": record["name"],
        **{k: v for k, v in record["extra"].items() if k != "ids"},
    }
    if record["exception"] is not None:
        line["exception"] = str(record["exception"].value)
    return json.dumps(line, default=str)


def _json_line(message: Any) -> None:
    sys.stderr.write(_json_text(message.record) + "\n")
    sys.stderr.flush()


def _json_format(record: Any) -> str:
    """A file sink's format: the JSON line itself, escaped so loguru does not read its braces."""
    record["extra"]["json_line"] = _json_text(record)
    return "{extra[json_line]}\n"


def _with_ids(record: Any) -> None:
    add_request_context(record)
    extra = record["extra"]
    ids = [f"{k}={extra[k]}" for k in ("request_id", "agent_id") if extra.get(k)]
    extra["ids"] = f"[{' '.join(ids)}] " if ids else ""


def configure_logging(settings: LoggingSection) -> None:
    logger.remove()
    logger.configure(patcher=_with_ids)
    # With a log file, stderr keeps warnings only: a service sends stderr to a file of its own.
    stderr_level = settings.level if settings.file is None else _at_least_warning(settings.level)
    if settings.format == "json":
        logger.add(_json_line, level=stderr_level, format="{message}")
    else:
        logger.add(sys.stderr, level=stderr_level, format=HUMAN_FORMAT, colorize=sys.stderr.isatty())
    if settings.file is not None:
        add_log_file(settings)


def add_log_file(settings: LoggingSection) -> Path:
    """The file sink: rotated past `rotate_mb`, the newest `keep_files` rotated files kept."""
    assert settings.file is not None
    path = Path(settings.file).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    file_format = _json_format if settings.format == "json" else HUMAN_FORMAT
    logger.add(
        path,
        level=settings.level,
        format=file_format,
        colorize=False,
        rotation=int(settings.rotate_mb * (1 << 20)),
        retention=settings.keep_files,
        encoding="utf-8",
    )
    return path


def _at_least_warning(level: str) -> str:
    return level if logger.level(level).no >= logger.level("WARNING").no else "WARNING"
