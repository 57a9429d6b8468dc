"""What a request must pass before it reaches the agents: the API key (and the caller's namespace,
see tenancy.py), shutdown, limits, rates.

The admission counter and the token buckets live on the event loop and are touched only there.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from semantic.actors.interface import AgentId
from semantic.protocols.errors import Overloaded, RateLimited, ShuttingDown
from semantic.protocols.settings import Settings
from semantic.protocols.tenancy import TENANT_KEY, Tenancy

OPEN_PATHS = ("/health/",)  # answered without an API key and during shutdown
MAX_TRACKED_AGENTS = 10_000


@dataclass(slots=True)
class TokenBucket:
    rate_per_s: float
    burst: int
    tokens: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = float(self.burst)

    def take(self, now: float | None = None) -> float:
        """Take one token: 0.0 if granted, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate_per_s


class Gate:
    """Admission for generation requests: at most `max_batch_size + max_queued` in flight."""

    def __init__(self, settings: Settings) -> None:
        self.tenancy = Tenancy.from_settings(settings.server)
        self.capacity = settings.engine.max_batch_size + settings.limits.max_queued
        self.num_in_flight = 0
        self.last_active = time.monotonic()
        self.is_shutting_down = False
        limits = settings.limits
        self._global = TokenBucket(limits.rate_per_s, limits.rate_burst) if limits.rate_per_s else None
        self._agent_rate = (limits.agent_rate_per_s, limits.agent_rate_burst)
        self._agents: OrderedDict[str, TokenBucket] = OrderedDict()

    def check_key(self, request: web.Request) -> None:
        """Refuse a missing or unknown key (401); note the caller's namespace on the request."""
        if self.tenancy is None or request.path.startswith(OPEN_PATHS):
            return
        given = request.headers.get("x-api-key", "")
        authorization = request.headers.get("Authorization", "")
        if not given and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        tenant = self.tenancy.tenant_of(given)
        if tenant is not None:
            request[TENANT_KEY] = tenant

    def check_open(self, request: web.Request) -> None:
        if self.is_shutting_down and not request.path.startswith(OPEN_PATHS):
            raise ShuttingDown("the server is shutting down; retry shortly", headers={"Retry-After": "5"})

    def admit(self, agent_id: str | None) -> None:
        """Take a slot and a token for one generation, or raise Overloaded / RateLimited."""
        if self.num_in_flight >= self.capacity:
            raise Overloaded(
                f"the server is at its limit of {self.capacity} requests in flight "
                "(engine.max_batch_size + limits.max_queued); retry shortly",
                headers={"Retry-After": "1"},
            )
        self.take_rate()
        rate, burst = self._agent_rate
        if agent_id is not None and rate:
            bucket = self._agents.pop(agent_id, None) or TokenBucket(rate, burst)
            self._agents[agent_id] = bucket
            if len(self._agents) > MAX_TRACKED_AGENTS:
                self._agents.popitem(last=False)
            if wait := bucket.take():
                raise RateLimited(
                    f"agent {AgentId(agent_id).local_id!r} is over its rate limit of {rate:g} "
                    f"requests/s (burst {burst})",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
        self.num_in_flight += 1
        self.last_active = time.monotonic()

    def take_rate(self) -> None:
        """Take a token from the whole server's bucket (`limits.rate_per_s`), or raise RateLimited: for
        each generation, and for other requests that cost the server work (creating an agent)."""
        if self._global is not None and (wait := self._global.take()):
            raise RateLimited(
                f"rate limit of {self._global.rate_per_s:g} requests/s (burst {self._global.burst}) exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )

    def release(self) -> None:
        assert self.num_in_flight > 0, "released a slot that was never admitted: guard bug"
        self.num_in_flight -= 1
        self.last_active = time.monotonic()

    def quiet_for_s(self) -> float:
        """Seconds since the last request was admitted or ended; 0 while any is in flight."""
        return 0.0 if self.num_in_flight else time.monotonic() - self.last_active
