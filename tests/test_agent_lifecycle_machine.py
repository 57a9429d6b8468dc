"""A stateful property test of the direct agent API on a real server (issues 63 and 78): Hypothesis
interleaves two tenants' creates, turns, deletes, evicts, unloads, graceful restarts and kill -9
(and creates or deletes racing a turn), `agents export` and `agents import` of archives, and
`cache gc --delete`, and checks after every step that every acknowledged turn is still there, no
deleted agent comes back, and neither tenant sees the other's agents.

The model is a tiny random-weight Llama (a step costs milliseconds); each example starts its own
server on a fresh cache folder with a keys file of two plain keys, and restarts it on the same
folder. The archive and gc commands run as a user would: the server stopped, then started again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.agent_api_client import call
from tests.server_process import ServerProcess

AGENT_IDS = st.sampled_from(["ada", "bob", "cy"])
TENANT_KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-fedcba9876543210"}
TENANTS = st.sampled_from(sorted(TENANT_KEYS))
TURN = {"content": "Hello there.", "max_tokens": 3, "temperature": 0}
Owned = tuple[str, str]  # (tenant, agent id as its client knows it)
# The machine restarts and kills servers on most steps, so it runs only as a soak (marked slow:
# `just test-slow`, which CI runs): SOAK_EXAMPLES examples, or LIFECYCLE_EXAMPLES where set.
SOAK_EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "10"))
NUM_STEPS = 20


class AgentLifecycle(RuleBasedStateMachine):
    model_dir: ClassVar[Path]
    num_steps_run: ClassVar[int] = 0
    num_restarts: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.cache_dir = Path(tempfile.mkdtemp(prefix="agent-machine-"))
        self.keys_file = self.cache_dir.parent / f"{self.cache_dir.name}.keys.toml"
        self.keys_file.write_text(
            'share_prefix_blocks = false\nadmin = ["alice"]\n[keys]\n'
            + "".join(f'"{key}" = "{tenant}"\n' for tenant, key in TENANT_KEYS.items())
        )
        self.keys_file.chmod(0o600)
        self.server = self._start()
        self.turns: dict[Owned, int] = {}  # live agents -> acknowledged turns (the model)
        self.systems: dict[Owned, str | None] = {}
        self.archives: list[tuple[Path, Owned, int]] = []  # exported: where, whose, turns then

    def _start(self) -> ServerProcess:
        args = ("--model", str(self.model_dir), "--cache-budget-mb", "64", "--block-size", "16")
        return ServerProcess(self.cache_dir, *args, "--api-keys-file", str(self.keys_file)).start()

    def _call(
        self, tenant: str, method: str, path: str, body: dict[str, str | int] | None = None
    ) -> tuple[int, Any]:
        return call(self.server, method, path, body, key=TENANT_KEYS[tenant])

    def _offline(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A `semantic agents|cache` command on the cache dir with the server stopped (SIGTERM
        writes every agent's cache), then the server started again."""
        assert self.server.stop(signal.SIGTERM, timeout=120) == 0, self.server.log()[-2000:]
        try:
            return subprocess.run(
                [sys.executable, "-m", "semantic.cli", *command, "--cache-dir", str(self.cache_dir)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            self.server = self._start()

    def teardown(self) -> None:
        if self.server.proc is not None and self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.proc.wait()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.keys_file.unlink(missing_ok=True)
        for archive, _, _ in self.archives:
            archive.unlink(missing_ok=True)

    # ---- rules ----

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def create(self, tenant: str, agent: str) -> None:
        system = f"You are {agent}, number {self.num_steps_run}."
        status, reply = self._call(tenant, "POST", "/v1/agents", {"id": agent, "system": system})
        if (tenant, agent) in self.turns:
            assert status == 409, reply
        else:
            assert status == 201, reply
            self.turns[tenant, agent], self.systems[tenant, agent] = 0, system
        self._count()

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def turn(self, tenant: str, agent: str) -> None:
        status, reply = self._call(tenant, "POST", f"/v1/agents/{agent}/messages", TURN)
        assert status == 200, reply  # a turn on an unknown id starts the agent
        self.turns[tenant, agent] = self.turns.get((tenant, agent), 0) + 1
        self.systems.setdefault((tenant, agent), None)
        self._count()

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def delete(self, tenant: str, agent: str) -> None:
        status, reply = self._call(tenant, "DELETE", f"/v1/agents/{agent}")
        assert status == (200 if (tenant, agent) in self.turns else 404), reply
        self.turns.pop((tenant, agent), None)
        self.systems.pop((tenant, agent), None)
        self._count()

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def evict(self, tenant: str, agent: str) -> None:
        status, reply = self._call(tenant, "POST", f"/v1/agents/{agent}/evict")
        assert status == 200, reply
        self._count()

    @rule()
    def unload(self) -> None:
        status, reply = self._call("bob", "POST", "/admin/models/unload")
        assert status == 403, reply  # a plain key never unloads everyone's model
        status, reply = self._call("alice", "POST", "/admin/models/unload")
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

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def create_beside_a_turn(self, tenant: str, agent: str) -> None:
        """Whichever runs first, the turn is kept and at most one of them creates the agent."""
        body = {"id": agent, "system": "Raced."}
        with ThreadPoolExecutor(2) as pool:
            turned = pool.submit(self._call, tenant, "POST", f"/v1/agents/{agent}/messages", TURN)
            created = pool.submit(self._call, tenant, "POST", "/v1/agents", body)
            (turn_status, turn_reply), (create_status, create_reply) = turned.result(), created.result()
        assert turn_status == 200, turn_reply
        if (tenant, agent) in self.turns:
            assert create_status == 409, create_reply
        else:
            assert create_status in (201, 409), create_reply
            self.systems[tenant, agent] = "Raced." if create_status == 201 else None
        self.turns[tenant, agent] = self.turns.get((tenant, agent), 0) + 1
        self._count()

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def delete_beside_a_turn(self, tenant: str, agent: str) -> None:
        """The turn either ran before the delete (gone with the agent), failed (409), or came after
        it (a new agent with that one turn): never the old history back."""
        with ThreadPoolExecutor(2) as pool:
            turned = pool.submit(self._call, tenant, "POST", f"/v1/agents/{agent}/messages", TURN)
            deleted = pool.submit(self._call, tenant, "DELETE", f"/v1/agents/{agent}")
            (turn_status, turn_reply), (delete_status, delete_reply) = turned.result(), deleted.result()
        assert turn_status in (200, 409), turn_reply
        assert delete_status in (200, 404), delete_reply
        if (tenant, agent) not in self.turns:  # unknown before: the delete found nothing, or the turn's agent
            assert turn_status == 200 or delete_status == 200, (turn_reply, delete_reply)
        status, info = self._call(tenant, "GET", f"/v1/agents/{agent}")
        if status == 404:
            self.turns.pop((tenant, agent), None)
            self.systems.pop((tenant, agent), None)
        else:
            assert turn_status == 200 and info["turns"] == 1, (turn_reply, delete_reply, info)
            self.turns[tenant, agent], self.systems[tenant, agent] = 1, None
        self._count()

    @rule(tenant=TENANTS, agent=AGENT_IDS)
    def export(self, tenant: str, agent: str) -> None:
        """`agents export` writes a live agent's files to an archive; an unknown agent is refused."""
        archive = self.cache_dir.parent / f"{self.cache_dir.name}.{len(self.archives)}.tar"
        done = self._offline("agents", "export", f"{tenant}~{agent}", "-o", str(archive))
        if (tenant, agent) in self.turns:
            assert done.returncode == 0, done.stderr
            self.archives.append((archive, (tenant, agent), self.turns[tenant, agent]))
        else:
            assert done.returncode != 0 and f"no agent {tenant}~{agent}" in done.stderr, done
        self._count()

    @rule(data=st.data())
    def import_(self, data: st.DataObject) -> None:
        """`agents import --force` puts the archived agent back as it was when exported, into its
        own tenant only (the namespace is part of its id)."""
        if not self.archives:
            return
        archive, owned, num_turns = data.draw(st.sampled_from(self.archives))
        done = self._offline("agents", "import", str(archive), "--force")
        assert done.returncode == 0, done.stderr
        self.turns[owned] = num_turns
        self.systems.setdefault(owned, None)
        self._count()

    @rule()
    def collect(self) -> None:
        """`cache gc --delete` removes only leftovers: no agent's files."""
        done = self._offline("cache", "gc", "--delete", "--older-than", "0")
        assert done.returncode == 0, done.stderr
        self._count()

    def _count(self) -> None:
        AgentLifecycle.num_steps_run += 1

    # ---- what must hold after every step ----

    @invariant()
    def every_acknowledged_turn_is_kept_and_deleted_agents_stay_deleted(self) -> None:
        for tenant in TENANT_KEYS:
            status, listing = self._call(tenant, "GET", "/v1/agents")
            assert status == 200, listing
            mine = sorted(agent for owner, agent in self.turns if owner == tenant)
            assert sorted(agent["id"] for agent in listing["data"]) == mine, (tenant, listing)
            for agent in ("ada", "bob", "cy"):
                status, info = self._call(tenant, "GET", f"/v1/agents/{agent}")
                if (tenant, agent) in self.turns:
                    assert status == 200 and info["turns"] == self.turns[tenant, agent], (tenant, agent, info)
                else:
                    assert status == 404, (tenant, agent, info)
                    assert not list(self.cache_dir.glob(f"agents/*/{tenant}~{agent}.*"))


def _run_machine(model_dir: Path, num_examples: int) -> None:
    AgentLifecycle.model_dir = model_dir
    AgentLifecycle.num_steps_run = AgentLifecycle.num_restarts = 0
    run_state_machine_as_test(
        AgentLifecycle,
        settings=settings(
            max_examples=num_examples,
            stateful_step_count=NUM_STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(  # the figures for the closing note (pytest -s shows them)
        f"agent lifecycle: {num_examples} examples, {AgentLifecycle.num_steps_run} steps, "
        f"{AgentLifecycle.num_restarts} restarts or kills"
    )
    assert AgentLifecycle.num_steps_run >= num_examples


@pytest.mark.slow
@pytest.mark.timeout(300 * SOAK_EXAMPLES)  # each example starts (and restarts) its own servers
def test_the_lifecycle_soak_loses_no_turn_and_brings_back_no_deleted_agent(tiny_llama_dir: Path) -> None:
    _run_machine(tiny_llama_dir, SOAK_EXAMPLES)
