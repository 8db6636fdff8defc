"""Agent memory: what an agent asked, answered and learnt from tools, carried across its tasks.

Kept in the DRAM tier (Redis) under ``{key_prefix}agent:{agent}:memory``, where
``agent`` is the agent's key, its tenant's and its id's
(:func:`switchyard.common.tenant.agent_key`: the bare id in the default tenant, so
that two tenants' agents of one id never read each other's memory), a
list of JSON messages ``{"role", "content", "name", "task_id"}``, oldest first:

- role ``user``: a task's payload; ``assistant``: its answer; ``tool``: a tool
  result it observed (``name`` is the tool).
- At most ``[agent_memory] max_entries`` messages (LTRIM drops the oldest), each
  cut to ``max_entry_chars``; the list expires ``ttl_s`` after the agent's
  last task (EXPIRE is renewed on every write).

A task with an ``agent_id`` recalls the newest messages that fit in
``recall_chars`` before its prompt is rendered and records its own after its
answer. Recalled tool results become system notes ("Earlier tool result ..."),
since a ``tool`` message without the assistant call that made it is not valid
chat input. Memory is an aid, never a condition: with Redis down a task runs
without it (see switchyard.common.dram).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from switchyard.common.config import AgentMemoryConfig
from switchyard.common.dram import DramClient
from switchyard.common.tenant import agent_key


@dataclass(frozen=True)
class MemoryMessage:
    """One remembered message."""

    role: str
    content: str
    name: str = ""
    task_id: str = ""

    def as_prompt(self) -> tuple[str, str]:
        """(role, content) as it enters a prompt."""
        if self.role == "tool":
            return "system", f"Earlier tool result from {self.name or 'a tool'}: {self.content}"
        return self.role, self.content


class AgentMemory:
    """Recall and record an agent's memory in the DRAM tier.

    Args:
        dram: the DRAM tier's client (degrades on outage).
        config: ``memory_policy.toml [agent_memory]``.
    """

    def __init__(self, dram: DramClient, config: AgentMemoryConfig) -> None:
        self.dram = dram
        self.config = config

    def _key(self, tenant: str, agent_id: str) -> str:
        return self.dram.key("agent", agent_key(tenant, agent_id), "memory")

    async def recall(self, tenant: str, agent_id: str) -> list[MemoryMessage]:
        """The newest messages of ``tenant``'s agent ``agent_id`` within ``recall_chars``, oldest first; [] when
        none or Redis is down."""
        if not agent_id or not self.config.enabled or self.config.recall_chars == 0:
            return []
        key = self._key(tenant, agent_id)
        raw = await self.dram.call(lambda r: r.lrange(key, 0, -1), [], "agent memory recall")
        messages: list[MemoryMessage] = []
        budget = self.config.recall_chars
        for item in reversed(raw):
            try:
                message = MemoryMessage(**json.loads(item))
            except (ValueError, TypeError):
                continue  # a foreign or corrupt entry is skipped, not fatal
            budget -= len(message.content)
            if budget < 0:
                break
            messages.append(message)
        messages.reverse()
        return messages

    async def record(self, tenant: str, agent_id: str, messages: list[MemoryMessage]) -> bool:
        """Append ``messages`` to the memory of ``tenant``'s agent ``agent_id``, trim it and renew its TTL.
        Returns whether Redis took them."""
        if not agent_id or not self.config.enabled or not messages:
            return False
        limit = self.config.max_entry_chars
        encoded = [
            json.dumps({"role": m.role, "content": m.content[:limit], "name": m.name, "task_id": m.task_id})
            for m in messages
        ]
        key = self._key(tenant, agent_id)

        async def write(redis):  # one MULTI/EXEC round trip
            async with redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, *encoded)
                pipe.ltrim(key, -self.config.max_entries, -1)
                pipe.pexpire(key, max(1, int(self.config.ttl_s * 1000)))
                await pipe.execute()
            return True

        return await self.dram.call(write, False, "agent memory record", grows=True)
