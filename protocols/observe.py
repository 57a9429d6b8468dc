"""Every request gets an id, a record of what it did, one summary log line and its metrics.

Handlers call `admit` before they start a generation (limits, rates, bounds) and `watch` on the
stream they get back (tokens, time to first token, the request timeout).
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from loguru import logger

from semantic.actors.cache_miss import CacheReport
from semantic.actors.interface import Event, Finished, PromptStarted, RequestStream, TokenDelta
from semantic.protocols.common import GATE_KEY, METRICS_KEY, SETTINGS_KEY
from semantic.protocols.errors import ApiError, RequestTimedOut, as_api_error, protocol_of

REQUEST_ID_HEADER = "X-Request-Id"
CACHE_HEADER = "x-semantic-cache"  # how the prompt met the agent's cached history (actors/cache_miss.py)
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    protocol: str
    started: float
    agent_id: str | None = None
    is_admitted: bool = False
    num_prompt_tokens: int = 0
    num_reused_tokens: int = 0
    num_generated_tokens: int = 0
    num_drafted_tokens: int = 0  # speculative decoding: drafts verified, and those kept
    num_accepted_tokens: int = 0
    cache_tier: str | None = None
    cache: CacheReport | None = None  # set before the reply's headers go out
    restore: str | None = None  # its agent's cache read from disk or computed again, and the estimates
    ttft_s: float | None = None
    handled_s: float | None = None  # from the request's start to the engine getting it
    engine_wait_s: float | None = None  # from there to joining the batch
    first_token_at: float | None = None
    outcome: str = "ok"
    timeout: asyncio.TimerHandle | None = None
    deadline_at: float | None = None  # loop time past `server.request_timeout_s`: until fully written


CURRENT = contextvars.ContextVar[RequestRecord | None]("semantic_request", default=None)
RECORD_KEY = web.RequestKey("record", RequestRecord)


def add_request_context(record: Any) -> None:
    """loguru patcher: lines logged while handling a request carry its request and agent ids."""
    current = CURRENT.get()
    if current is not None:
        record["extra"].setdefault("request_id", current.request_id)
        if current.agent_id:
            record["extra"].setdefault("agent_id", current.agent_id)


def record_of(request: web.Request) -> RequestRecord:
    record: RequestRecord = request[RECORD_KEY]
    return record


def check_bounds(
    request: web.Request,
    *,
    max_tokens: int | None = None,
    num_messages: int = 0,
    num_tools: int = 0,
    num_prompt_tokens: int = 0,
) -> None:
    """Refuse a request past the configured bounds, saying which bound and its limit."""
    limits = request.app[SETTINGS_KEY].limits
    checks = [
        ("max_tokens", max_tokens or 0, limits.max_tokens, "limits.max_tokens"),
        ("messages", num_messages, limits.max_messages, "limits.max_messages"),
        ("tools", num_tools, limits.max_tools, "limits.max_tools"),
        ("prompt tokens", num_prompt_tokens, limits.max_prompt_tokens, "limits.max_prompt_tokens"),
    ]
    for what, value, limit, setting in checks:
        if value > limit:
            raise ApiError(f"{what}: {value} is more than this server allows ({limit}, set by {setting})")


def admit(request: web.Request, agent_id: str | None) -> None:
    """Take a generation slot (released when the request ends), or raise Overloaded / RateLimited."""
    record = record_of(request)
    record.agent_id = agent_id
    request.app[GATE_KEY].admit(agent_id)
    record.is_admitted = True


def watch(request: web.Request, stream: RequestStream) -> RequestStream:
    """Record the stream's tokens and timings, and fail it past `server.request_timeout_s` (the
    deadline holds until the reply is written: `SseWriter` takes it too)."""
    record = record_of(request)
    metrics = request.app[METRICS_KEY]
    timeout_s = request.app[SETTINGS_KEY].server.request_timeout_s

    def observe(event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, PromptStarted):
            record.num_prompt_tokens = event.num_prompt_tokens
            record.num_reused_tokens = event.num_cached_tokens
            record.cache_tier = event.cache_tier
            if record.cache is not None:  # the header states the reuse the log line states
                record.cache = record.cache.served(event.num_cached_tokens)
            if event.queued_at:
                record.handled_s = max(0.0, event.queued_at - record.started)
                record.engine_wait_s = event.waited_s
                metrics.engine_wait.observe(record.engine_wait_s)
            metrics.cache_lookups.labels(event.cache_tier).inc()
            metrics.prompt_tokens.labels("reused").inc(event.num_cached_tokens)
            metrics.prompt_tokens.labels("prefilled").inc(event.num_prompt_tokens - event.num_cached_tokens)
        elif isinstance(event, TokenDelta):
            record.num_generated_tokens += len(event.token_ids)  # counted as they come: a client may leave
            if record.first_token_at is None:
                record.first_token_at = now
                record.ttft_s = now - record.started
                metrics.ttft.labels(record.protocol).observe(record.ttft_s)
        elif isinstance(event, Finished):
            record.num_generated_tokens = event.num_generated_tokens
            record.num_drafted_tokens = event.num_drafted_tokens
            record.num_accepted_tokens = event.num_accepted_tokens
            metrics.generated.inc(event.num_generated_tokens)
            metrics.drafted.inc(event.num_drafted_tokens)
            metrics.accepted.inc(event.num_accepted_tokens)
            if (
                record.first_token_at is not None
                and event.num_generated_tokens > 1
                and now > record.first_token_at
            ):
                metrics.decode_rate.observe((event.num_generated_tokens - 1) / (now - record.first_token_at))
        elif isinstance(event, BaseException):
            record.outcome = getattr(event, "kind", type(event).__name__)

    def time_out() -> None:
        if stream.finished is not None:
            return  # read to its end: a write still waiting is the SseWriter's to end
        record.outcome = "timeout"
        stream.fail(
            RequestTimedOut(f"the request took longer than {timeout_s:g} s (server.request_timeout_s)")
        )

    loop = asyncio.get_running_loop()
    record.deadline_at = loop.time() + timeout_s
    record.timeout = loop.call_at(record.deadline_at, time_out)
    stream.observers.append(observe)
    return stream


@web.middleware
async def observed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, loguru context, the gate's checks, metrics and the one summary line."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _VALID_REQUEST_ID.match(given) else f"req_{uuid.uuid4().hex}"
    record = RequestRecord(request_id, protocol_of(request.path), time.monotonic())
    request[RECORD_KEY] = record
    token = CURRENT.set(record)
    gate = request.app[GATE_KEY]
    metrics = request.app[METRICS_KEY]
    status = 500
    try:
        gate.check_open(request)
        gate.check_key(request)
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        record.outcome = "client disconnected"
        status = 499
        raise
    except Exception as error:
        api_error = as_api_error(error)
        status = api_error.status
        record.outcome = api_error.kind
        if api_error is error:
            raise
        raise api_error from error
    finally:
        if record.timeout is not None:
            record.timeout.cancel()
        if record.is_admitted:
            gate.release()
        duration = time.monotonic() - record.started
        if not request.path.startswith(("/health/", "/metrics")):
            metrics.requests.labels(record.protocol, str(status)).inc()
            metrics.request_duration.labels(record.protocol).observe(duration)
            _log_summary(request, record, status, duration)
        CURRENT.reset(token)


def _log_summary(request: web.Request, record: RequestRecord, status: int, duration: float) -> None:
    if status >= 400 and record.outcome == "ok":
        record.outcome = f"http_{status}"

    def seconds(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "-"

    logger.bind(
        request_id=record.request_id,
        agent_id=record.agent_id,
        protocol=record.protocol,
        method=request.method,
        path=request.path,
        status=status,
        prompt_tokens=record.num_prompt_tokens,
        reused_tokens=record.num_reused_tokens,
        generated_tokens=record.num_generated_tokens,
        drafted_tokens=record.num_drafted_tokens,
        accepted_tokens=record.num_accepted_tokens,
        cache_tier=record.cache_tier,
        cache=record.cache.header() if record.cache is not None else None,
        restore=record.restore,
        ttft_s=record.ttft_s,
        handled_s=record.handled_s,
        engine_wait_s=record.engine_wait_s,
        duration_s=round(duration, 4),
        outcome=record.outcome,
    ).info(
        "{} {} {} protocol={} agent={} prompt={} reused={} generated={} drafts={}/{} cache={} restore={} "
        "handled={}s "
        "engine_wait={}s ttft={}s duration={:.3f}s outcome={}",
        request.method,
        request.path,
        status,
        record.protocol,
        record.agent_id or "-",
        record.num_prompt_tokens,
        record.num_reused_tokens,
        record.num_generated_tokens,
        record.num_accepted_tokens,
        record.num_drafted_tokens,
        _cache_text(record.cache),
        record.restore or "-",
        seconds(record.handled_s),
        seconds(record.engine_wait_s),
        seconds(record.ttft_s),
        duration,
        record.outcome,
    )


def _cache_text(report: CacheReport | None) -> str:
    """The x-semantic-cache header without spaces: `reused=1234/1500,parted=1234,...,reason=...`."""
    return "-" if report is None else report.header().replace("; ", ",")


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    record = request.get(RECORD_KEY)
    if record is not None:
        response.headers[REQUEST_ID_HEADER] = record.request_id
        response.headers["request-id"] = record.request_id
        if record.cache is not None:
            response.headers[CACHE_HEADER] = record.cache.header()
