"""Prompt rendering with Jinja2's sandbox.

Templates live in ``templates/`` beside this module. User text is passed as
template *data* and is never compiled as a template, so a payload such as
``{{ 7 * 7 }}`` reaches the model literally; the sandbox additionally stops
templates from reaching unsafe attributes.

A workflow whose passages are known last (rag_answer: they come from retrieval)
renders them after the question, in the user message (``<workflow>.context.j2``),
so that system prompt + question is a prefix of the whole prompt: it can be sent
ahead while retrieval runs (:func:`static_prefix`) and the full prompt extends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from jinja2 import FileSystemLoader, StrictUndefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


class Snippet(NamedTuple):
    """A titled text handed to a template: a retrieved passage (title, text) or a tool (name, description)."""

    title: str
    text: str

    @property
    def name(self) -> str:
        return self.title

    @property
    def description(self) -> str:
        return self.text


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as chat messages, plus the same text joined for engines that take one string.

    ``history`` holds (role, content) pairs recalled from the agent's memory; they sit between the
    system message and the question.
    """

    system: str
    user: str
    history: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        return "\n\n".join([self.system, *(content for _, content in self.history), self.user])

    def messages(self) -> list[tuple[str, str]]:
        """(role, content) pairs in order."""
        return [("system", self.system), *self.history, ("user", self.user)]


@lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(
        loader=FileSystemLoader(TEMPLATE_DIR),
        undefined=StrictUndefined,
        autoescape=False,  # prompts are plain text, not HTML
        keep_trailing_newline=False,
        trim_blocks=True,
        auto_reload=False,  # the templates ship with the code: no stat of their files per render
    )


@lru_cache(maxsize=None)
def _template(name: str) -> Any:
    return _env().get_template(name)


CONTEXT_AFTER_QUESTION = frozenset({"rag_answer"})
"""Workflows whose passages follow the question (``<workflow>.context.j2``)."""


def render(
    workflow: str,
    question: str,
    passages: Sequence[Any] = (),
    tools: Sequence[Any] = (),
    history: Sequence[tuple[str, str]] = (),
) -> RenderedPrompt:
    """Render the system and user messages of ``workflow`` (rag_answer, chat, react_loop).

    Args:
        workflow: template prefix in ``templates/``.
        question: the user's payload (data, never template code).
        passages: objects with ``title`` and ``text`` (retrieval results).
        tools: objects with ``name`` and ``description``.
        history: (role, content) pairs from the agent's memory, oldest first (data, never template code).

    Raises:
        jinja2.TemplateNotFound: no template for ``workflow``.
    """
    system, user = _static_parts(workflow, question, tools)
    if workflow in CONTEXT_AFTER_QUESTION:
        user = f"{user}\n\n{_template(f'{workflow}.context.j2').render(passages=list(passages)).strip()}"
    return RenderedPrompt(system, user, tuple((str(r), str(c)) for r, c in history))


def _static_parts(workflow: str, question: str, tools: Sequence[Any] = ()) -> tuple[str, str]:
    system = _template(f"{workflow}.system.j2").render(tools=list(tools))
    user = _template("question.user.j2").render(question=question)
    return system.strip(), user.strip()


def bare(workflow: str, question: str) -> RenderedPrompt:
    """``workflow``'s prompt for ``question`` with nothing added (no passages, tools or history): every prompt
    :func:`render` makes of that question holds these messages' text, so their tokens are the least any of
    them takes.

    Raises:
        jinja2.TemplateNotFound: no template for ``workflow``.
    """
    return RenderedPrompt(*_static_parts(workflow, question))


def static_prefix(workflow: str, question: str) -> str:
    """The part of ``render(workflow, question, passages).text`` known before the passages: system prompt and
    question, a true prefix of the text of every prompt of that question rendered without history.

    Raises:
        ValueError: ``workflow`` does not render its passages after the question (:data:`CONTEXT_AFTER_QUESTION`).
    """
    if workflow not in CONTEXT_AFTER_QUESTION:
        raise ValueError(f"workflow: {workflow} renders no passages after its question; expected one of "
                         f"{', '.join(sorted(CONTEXT_AFTER_QUESTION))}")
    return "\n\n".join(_static_parts(workflow, question))
