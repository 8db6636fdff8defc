"""Built-in tools of the react_loop workflow and the retried tool call.

- ``calculator``: arithmetic on numbers with + - * / // % ** and parentheses,
  evaluated by walking Python's AST (never ``eval``), with bounds on exponent
  and result size so a request cannot make the process compute forever.
- ``search_docs``: a vector search through the retrieval service.

Each call is retried with tenacity (attempts, exponential backoff and a
per-attempt timeout from ``orchestrator.react`` in switchyard.json). Argument
errors are the caller's mistake and are not retried.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from switchyard.common import untrusted
from switchyard.common.errors import SwitchyardError
from switchyard.common.config import ReactConfig
from switchyard.common.metrics import TOOL_NAMES as _TOOL_NAMES


class ToolArgumentError(ValueError):
    """The model called a tool with arguments that do not fit its schema. Not retried."""


NOT_RETRIED_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
})
"""A tool's downstream error that the same call gets again, so it is not retried: the request's own fault
(gRPC's status code guide: the client retries these only after changing the request)."""


def _retried(exc: BaseException) -> bool:
    """Whether a tool's failure is tried again: any failure of the tool, but the task's cancellation
    (CancelledError, a BaseException that tenacity's retry_if_not_exception_type would retry too), bad
    arguments, and a downstream error in :data:`NOT_RETRIED_CODES`."""
    if not isinstance(exc, Exception) or isinstance(exc, ToolArgumentError):
        return False
    return not (isinstance(exc, SwitchyardError) and exc.code in NOT_RETRIED_CODES)


@dataclass(frozen=True)
class Tool:
    """A callable tool in the OpenAI function-calling shape."""

    name: str
    description: str
    parameters: dict[str, Any]
    call: Callable[[dict[str, Any]], Awaitable[str]]

    @property
    def parameters_json(self) -> str:
        return json.dumps(self.parameters)


# ----------------------------------------------------------------------------- calculator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100


def calculate(expression: str) -> float | int:
    """Evaluate an arithmetic expression safely.

    Raises:
        ToolArgumentError: anything other than numbers, + - * / // % ** and
            parentheses; an exponent above 64; a result above 1e100; division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolArgumentError(f"expression: expected at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolArgumentError(f"expression: expected arithmetic, got {expression!r}") from None

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if isinstance(node.value, float) and not math.isfinite(node.value):  # 1e400 reads as inf
                raise ToolArgumentError("expression: number out of range")
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolArgumentError(f"expression: exponent {right} above the limit {MAX_EXPONENT}")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolArgumentError("expression: division by zero") from None
            except OverflowError:  # (10.0 ** 60) ** 6, or an int too large for a float: the same every time
                raise ToolArgumentError("expression: result out of range") from None
            if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
                raise ToolArgumentError("expression: result out of range")
            return value
        raise ToolArgumentError(f"expression: only numbers and + - * / // % ** ( ) are allowed, got {expression!r}")

    return walk(tree)


def _required_text(args: dict[str, Any], name: str) -> str:
    """The non-empty string argument ``name``.

    Raises:
        ToolArgumentError: missing, not a string, or blank.
    """
    value = args.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolArgumentError(f"{name}: expected a non-empty string")
    return value


async def _calculator(args: dict[str, Any]) -> str:
    expression = _required_text(args, "expression")
    value = calculate(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{expression.strip()} = {value}"


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (3 + 4) * 12"}},
        "required": ["expression"],
    },
    call=_calculator,
)


TOOL_NAMES = _TOOL_NAMES
"""The registered tools (react.py offers them): the label set of the tool metrics
(:data:`switchyard.common.metrics.TOOL_NAMES`, shared with the dispatcher's tool-wait metrics)."""


def search_docs_tool(search: Callable[[str, int], Awaitable[list[Any]]], top_k: int = 3) -> Tool:
    """The ``search_docs`` tool bound to a retrieval function ``search(query, top_k) -> passages``."""

    async def _search(args: dict[str, Any]) -> str:
        passages = await search(_required_text(args, "query"), top_k)
        if not passages:
            return "no passages found"
        return "\n\n".join(f"[{i}] {p.title} ({p.source})\n{p.text}" for i, p in enumerate(passages, 1))

    return Tool(
        name="search_docs",
        description="Search the documentation index and return the most relevant passages.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
        },
        call=_search,
    )


@dataclass(frozen=True)
class ToolOutcome:
    content: str
    is_error: bool
    attempts: int


async def call_tool(tool: Tool, arguments_json: str, policy: ReactConfig) -> ToolOutcome:
    """Run ``tool`` with retries; failures become an error result the agent can observe.

    Returns the tool's text, or the last error's text with ``is_error`` set, and
    the number of attempts made. Never raises for tool failures.

    Raises:
        asyncio.CancelledError: the task was cancelled (CancelTask, its caller gone) while the tool ran: at
            once, not retried.
    """
    try:
        args = untrusted.loads(arguments_json or "{}")
        if not isinstance(args, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        return ToolOutcome(f"arguments: expected a JSON object ({exc})", True, 1)
    attempts = 0
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(policy.tool_attempts),
            wait=wait_exponential(
                multiplier=policy.tool_backoff_initial_ms / 1000, max=policy.tool_backoff_max_ms / 1000
            ),
            retry=retry_if_exception(_retried),
            reraise=True,
        ):
            with attempt:
                attempts = attempt.retry_state.attempt_number
                content = await asyncio.wait_for(tool.call(args), policy.tool_timeout_ms / 1000)
        return ToolOutcome(content, False, attempts)
    except asyncio.TimeoutError:
        return ToolOutcome(f"{tool.name} timed out after {policy.tool_timeout_ms:.0f} ms", True, attempts)
    except Exception as exc:  # noqa: BLE001 - the agent observes the failure
        return ToolOutcome(f"{tool.name} failed: {exc}", True, attempts)
