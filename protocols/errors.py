"""Errors in the shape of the API that was called, whoever raises them (handlers or middleware)."""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Mapping

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from loguru import logger

from semantic.actors.agent_messages import AgentDeletedError, AgentStoppedError, MailboxFullError
from semantic.actors.interface import EngineError, PersistenceStoppedError, UnknownModelError
from semantic.actors.model_session import ModelSwitchForbiddenError, ModelUnavailableError

_encode = msgspec.json.Encoder().encode
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    507: "api_error",
    529: "overloaded_error",
}


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    error: AnthropicErrorDetail
    type: str = "error"


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorDetail


class AgentErrorDetail(msgspec.Struct):
    type: str
    message: str


class AgentError(msgspec.Struct):
    error: AgentErrorDetail


def _json(status: int, body: msgspec.Struct) -> web.Response:
    return web.Response(status=status, body=_encode(body), content_type="application/json")


def anthropic_error(status: int, message: str) -> web.Response:
    return _json(
        status, AnthropicError(AnthropicErrorDetail(ANTHROPIC_ERROR_TYPES.get(status, "api_error"), message))
    )


def openai_error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    return _json(status, OpenAIError(OpenAIErrorDetail(message, kind, param, str(status))))


def agent_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return _json(status, AgentError(AgentErrorDetail(kind, message)))


class ApiError(Exception):
    """A refusal with an HTTP status; rendered in the protocol's own error shape."""

    status = 400
    kind = "invalid_request_error"

    def __init__(
        self, message: str, status: int | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status or self.status
        self.headers = dict(headers or {})


class Unauthorized(ApiError):
    status = 401
    kind = "authentication_error"


class Forbidden(ApiError):
    status = 403
    kind = "permission_error"


class Overloaded(ApiError):
    """Past the concurrency or queue limit: 429 (never a 5xx; clients retry after Retry-After)."""

    status = 429
    kind = "rate_limit_error"


class RateLimited(ApiError):
    status = 429
    kind = "rate_limit_error"


class ShuttingDown(ApiError):
    status = 503
    kind = "overloaded_error"


class RequestTimedOut(ApiError):
    status = 504
    kind = "timeout_error"


class NotFound(ApiError):
    status = 404
    kind = "not_found_error"


class Unavailable(ApiError):
    """Nothing the client did wrong, and worth retrying: no model ready, a swap, a stopping agent."""

    status = 503
    kind = "overloaded_error"


class InsufficientStorage(ApiError):
    """The disk (or the user's quota) is full: nothing the client did, and no retry helps soon."""

    status = 507
    kind = "insufficient_storage"


class InternalError(ApiError):
    status = 500
    kind = "api_error"


DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE}
# Rust's io::Error (safetensors, tokenizers) says "No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def errno_of(error: BaseException) -> int | None:
    """The OS error number behind `error`: its own, one in a Rust library's message, or its cause's."""
    for _ in range(8):  # a cause chain is short; a cycle must not loop
        number = getattr(error, "errno", None)
        if isinstance(number, int):
            return number
        if found := _RUST_OS_ERROR.search(str(error)):
            return int(found.group(1))
        if error.__cause__ is None:
            return None
        error = error.__cause__
    return None


def as_api_error(error: BaseException) -> ApiError:
    """The one place a failure becomes a status: the same condition gets the same status on every API.

    Bad input is 400 (ValueError and its kin: ids, content, templates, prompt length, sampling; JSON
    nested deeper than the recursion limit; a body aiohttp cannot decode);
    unknown models 404; a full mailbox 429; the model or an agent not available now 503; a full
    disk 507 and no file descriptors left 503, whoever raised the OSError; anything else is our
    fault: 500, logged with the request id.
    """
    match error:
        case ApiError():
            return error
        case UnknownModelError():
            return NotFound(str(error).strip("'\""))
        case MailboxFullError():
            return Overloaded(str(error), headers={"Retry-After": str(error.retry_after_s)})
        case ModelSwitchForbiddenError():
            return Forbidden(str(error))
        case AgentDeletedError():
            return ApiError(str(error), status=409)
        case ModelUnavailableError() | AgentStoppedError() | PersistenceStoppedError() | EngineError():
            return Unavailable(str(error), headers={"Retry-After": "5"})
        case RequestPayloadError():  # a body aiohttp cannot decode (Content-Encoding, chunking)
            reason = getattr(error.__cause__, "message", None) or str(error)
            return ApiError(f"request body could not be read: {reason}")
        case msgspec.ValidationError():
            return ApiError(f"invalid request body: {error}")
        case msgspec.DecodeError():
            return ApiError(f"request body is not valid JSON: {error}")
        case RecursionError():  # JSON nested past the decoders' depth (Python's recursion limit)
            return ApiError(f"request nests JSON too deeply: {error}")
        case ValueError():
            return ApiError(str(error))
    number = errno_of(error)
    if number in DISK_FULL:
        logger.error("the disk is full: {}", error)
        return InsufficientStorage(f"the server's disk is full: {error}")
    if number in OUT_OF_DESCRIPTORS:
        logger.warning("out of file descriptors: {}", error)
        return Unavailable(f"the server is out of file descriptors: {error}", headers={"Retry-After": "1"})
    logger.opt(exception=error).error("internal error: {}", error)
    return InternalError(f"internal error: {type(error).__name__}: {error}")


def protocol_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith(("/v1/chat", "/v1/completions", "/v1/models")):
        return "openai"
    if path.startswith("/v1/agents"):
        return "agents"
    return "other"


def error_response(
    path: str, status: int, message: str, kind: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    protocol = protocol_of(path)
    if protocol == "anthropic":
        response = anthropic_error(status, message)
    elif protocol == "openai":
        openai_kind = {"rate_limit_error": "rate_limit_exceeded"}
        response = openai_error(status, message, kind=openai_kind.get(kind, kind))
    else:
        response = agent_error(status, message, kind)
    response.headers.update(headers or {})
    return response


def api_error_response(path: str, error: ApiError) -> web.Response:
    return error_response(path, error.status, str(error), error.kind, error.headers)


@web.middleware
async def errors_in_protocol_shape(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiErrors and aiohttp's own errors (404, 405, 413) in the error shape of the API called."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = (
            f"{error.reason}: {error.text}" if error.text and error.text != error.reason else error.reason
        )
        if error.status == 413:
            message = f"request body too large: {error.text}"
        return error_response(
            request.path, error.status, message, "http_error" if error.status != 413 else "request_too_large"
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:
        return api_error_response(request.path, as_api_error(error))
