"""The models a server may run: each with a name, a source and aliases; requests name one of them.

A requested name resolves to a registry entry (its name, or one of its alias globs), or to "the
loaded model" through the loaded-model aliases (`claude*`, `gpt-*`, `default`: clients that ask for
a model we cannot have get whatever is loaded rather than a swap).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from semantic.engine.model.default_model import model_name_for

# Requested names (globs) that mean "whatever model is loaded now".
LOADED_MODEL_ALIASES = ("default", "claude*", "gpt-*")


class UnknownModelError(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    source: str
    aliases: tuple[str, ...] = ()

    @classmethod
    def from_source(cls, source: str, name: str | None = None) -> ModelEntry:
        return cls(name or model_name_for(source), source)

    def answers_to(self, requested: str) -> bool:
        return requested == self.name or any(fnmatch.fnmatchcase(requested, a) for a in self.aliases)


class ModelRegistry:
    """Entries by name, the first being the one served at start-up."""

    def __init__(
        self,
        entries: Iterable[ModelEntry],
        aliases: Mapping[str, str] | None = None,
        loaded_aliases: Iterable[str] = LOADED_MODEL_ALIASES,
    ) -> None:
        """`aliases` maps a glob to an entry name ("" for the loaded model)."""
        self._entries: dict[str, ModelEntry] = {}
        for entry in entries:
            if entry.name in self._entries:
                raise ValueError(f"model name {entry.name!r} is configured twice")
            self._entries[entry.name] = entry
        if not self._entries:
            raise ValueError("the model registry needs at least one model")
        self.loaded_aliases = list(loaded_aliases)
        for pattern, target in (aliases or {}).items():
            if not pattern:
                raise ValueError("an alias needs a name (a glob such as 'claude-haiku*')")
            if target == "":
                self.loaded_aliases.append(pattern)
                continue
            aliased = self._entries.get(target)
            if aliased is None:
                raise ValueError(
                    f"alias {pattern!r} names model {target!r}, which is not configured "
                    f"(configured: {', '.join(self._entries)})"
                )
            self._entries[target] = ModelEntry(aliased.name, aliased.source, (*aliased.aliases, pattern))

    @property
    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    @property
    def initial(self) -> ModelEntry:
        return next(iter(self._entries.values()))

    def get(self, name: str) -> ModelEntry | None:
        return self._entries.get(name)

    def resolve(self, requested: str | None) -> ModelEntry | None:
        """The entry a request names; None when it means the loaded model (or names none)."""
        if not requested:
            return None
        exact = self._entries.get(requested)
        if exact is not None:
            return exact
        for entry in self._entries.values():
            if entry.answers_to(requested):
                return entry
        if any(fnmatch.fnmatchcase(requested, pattern) for pattern in self.loaded_aliases):
            return None
        raise UnknownModelError(
            f"model {requested!r} is not served here; configured models: {', '.join(self._entries)} "
            f"(also accepted for the loaded model: {', '.join(self.loaded_aliases)}; "
            "add more with --alias NAME=MODEL or --add-model NAME=SOURCE)"
        )
