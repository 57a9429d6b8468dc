"""A stateful property test of the direct agent API on a real server (issue 63): Hypothesis
interleaves creates, turns, deletes, evicts, unloads, graceful restarts and kill -9 (and creates or
deletes racing a turn) and checks after every step that every acknowledged turn is still there and
no deleted agent comes back.

The model is a tiny random-weight Llama (a step costs milliseconds); each example starts its own
server on a fresh cache folder, and restarts it on the same folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.agent_api_client import call
from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_model

AGENT_IDS = st.sampled_from(["ada", "bob", "cy"])
TURN = {"content": "Hello there.", "max_tokens": 3, "temperature": 0}
# Bounded for the default suite; a longer soak: LIFECYCLE_EXAMPLES=50.
NUM_EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "5"))
NUM_STEPS = 20


class AgentLifecycle(RuleBasedStateMachine):
    model_dir: ClassVar[Path]
    num_steps_run: ClassVar[int] = 0
    num_restarts: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.cache_dir = Path(tempfile.mkdtemp(prefix="agent-machine-"))
        self.server = self._start()
        self.turns: dict[str, int] = {}  # live agents -> acknowledged turns (the model)
        self.systems: dict[str, str | None] = {}

    def _start(self) -> ServerProcess:
        args = ("--model", str(self.model_dir), "--cache-budget-mb", "64", "--block-size", "16")
        return ServerProcess(self.cache_dir, *args).start()

    def teardown(self) -> None:
        if self.server.proc is not None and self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.proc.wait()
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    # ---- rules ----

    @rule(agent=AGENT_IDS)
    def create(self, agent: str) -> None:
        system = f"You are {agent}, number {self.num_steps_run}."
        status, reply = call(self.server, "POST", "/v1/agents", {"id": agent, "system": system})
        if agent in self.turns:
            assert status == 409, reply
        else:
            assert status == 201, reply
            self.turns[agent], self.systems[agent] = 0, system
        self._count()

    @rule(agent=AGENT_IDS)
    def turn(self, agent: str) -> None:
        status, reply = call(self.server, "POST", f"/v1/agents/{agent}/messages", TURN)
        assert status == 200, reply  # a turn on an unknown id starts the agent
        self.turns[agent] = self.turns.get(agent, 0) + 1
        self.systems.setdefault(agent, None)
        self._count()

    @rule(agent=AGENT_IDS)
    def delete(self, agent: str) -> None:
        status, reply = call(self.server, "DELETE", f"/v1/agents/{agent}")
        assert status == (200 if agent in self.turns else 404), reply
        self.turns.pop(agent, None)
        self.systems.pop(agent, None)
        self._count()

    @rule(agent=AGENT_IDS)
    def evict(self, agent: str) -> None:
        status, reply = call(self.server, "POST", f"/v1/agents/{agent}/evict")
        assert status == 200, reply
        self._count()

    @rule()
    def unload(self) -> None:
        status, reply = call(self.server, "POST", "/admin/models/unload")
        assert status == 200, reply
        self._count()

    @rule(kill=st.booleans())
    def restart(self, kill: bool) -> None:
        """kill -9 loses no acknowledged turn (each is fsynced before its reply); SIGTERM exits 0."""
        code = self.server.stop(signal.SIGKILL if kill else signal.SIGTERM, timeout=120)
        assert code == (-signal.SIGKILL if kill else 0), self.server.log()[-2000:]
        self.server = self._start()
        AgentLifecycle.num_restarts += 1
        self._count()

    @rule(agent=AGENT_IDS)
    def create_beside_a_turn(self, agent: str) -> None:
        """Whichever runs first, the turn is kept and at most one of them creates the agent."""
        body = {"id": agent, "system": "Raced."}
        with ThreadPoolExecutor(2) as pool:
            turned = pool.submit(call, self.server, "POST", f"/v1/agents/{agent}/messages", TURN)
            created = pool.submit(call, self.server, "POST", "/v1/agents", body)
            (turn_status, turn_reply), (create_status, create_reply) = turned.result(), created.result()
        assert turn_status == 200, turn_reply
        if agent in self.turns:
            assert create_status == 409, create_reply
        else:
            assert create_status in (201, 409), create_reply
            self.systems[agent] = "Raced." if create_status == 201 else None
        self.turns[agent] = self.turns.get(agent, 0) + 1
        self._count()

    @rule(agent=AGENT_IDS)
    def delete_beside_a_turn(self, agent: str) -> None:
        """The turn either ran before the delete (gone with the agent), failed (409), or came after
        it (a new agent with that one turn): never the old history back."""
        with ThreadPoolExecutor(2) as pool:
            turned = pool.submit(call, self.server, "POST", f"/v1/agents/{agent}/messages", TURN)
            deleted = pool.submit(call, self.server, "DELETE", f"/v1/agents/{agent}")
            (turn_status, turn_reply), (delete_status, delete_reply) = turned.result(), deleted.result()
        assert turn_status in (200, 409), turn_reply
        assert delete_status in (200, 404), delete_reply
        if agent not in self.turns:  # unknown before: the delete found nothing, or the turn's agent
            assert turn_status == 200 or delete_status == 200, (turn_reply, delete_reply)
        status, info = call(self.server, "GET", f"/v1/agents/{agent}")
        if status == 404:
            self.turns.pop(agent, None)
            self.systems.pop(agent, None)
        else:
            assert turn_status == 200 and info["turns"] == 1, (turn_reply, delete_reply, info)
            self.turns[agent], self.systems[agent] = 1, None
        self._count()

    def _count(self) -> None:
        AgentLifecycle.num_steps_run += 1

    # ---- what must hold after every step ----

    @invariant()
    def every_acknowledged_turn_is_kept_and_deleted_agents_stay_deleted(self) -> None:
        status, listing = call(self.server, "GET", "/v1/agents")
        assert status == 200, listing
        assert sorted(agent["id"] for agent in listing["data"]) == sorted(self.turns), listing
        for agent in ("ada", "bob", "cy"):
            status, info = call(self.server, "GET", f"/v1/agents/{agent}")
            if agent in self.turns:
                assert status == 200 and info["turns"] == self.turns[agent], (agent, self.turns, info)
            else:
                assert status == 404, (agent, info)
                assert not list(self.cache_dir.glob(f"agents/*/{agent}.*"))


@pytest.fixture(scope="module")
def tiny_llama_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("machine-model"), default_model_dir)


def test_no_acknowledged_turn_is_lost_and_no_deleted_agent_comes_back(tiny_llama_dir: Path) -> None:
    AgentLifecycle.model_dir = tiny_llama_dir
    AgentLifecycle.num_steps_run = AgentLifecycle.num_restarts = 0
    run_state_machine_as_test(
        AgentLifecycle,
        settings=settings(
            max_examples=NUM_EXAMPLES,
            stateful_step_count=NUM_STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(  # the figures for the closing note (pytest -s shows them)
        f"agent lifecycle: {NUM_EXAMPLES} examples, {AgentLifecycle.num_steps_run} steps, "
        f"{AgentLifecycle.num_restarts} restarts or kills"
    )
    assert AgentLifecycle.num_steps_run >= NUM_EXAMPLES
