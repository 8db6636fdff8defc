"""What a tenant reads of an error: the messages that leave the orchestrator's edge, internal addresses hidden.

An error message names where it happened: the model server's URL (``upstream 503 from
http://10.0.3.7:8000/v1/chat/completions (upstream said ...)``), a pool's endpoints (``10.0.3.7:8000``), a
downstream service's address (``dispatcher service unavailable at 10.0.0.5:50053``), a proxy's, and sometimes
a URL inside the server's own quoted words. The operator needs them (logs, spans and ``switchyard doctor``
keep them whole); a tenant of a shared deployment does not, and they tell it the deployment's topology. So is
an orchestrator instance's id (``host:pid:tag``) in the words of a task held elsewhere or orphaned: the caller
reads ``orchestrator instance <tag>``.

:class:`EdgeText` is the one place such a message is rewritten for its caller: every exit of the edge passes
through it (the gRPC status details of every AgentService method, a task's stored error as GetTaskStatus and
CancelTask answer it, and the HTTP face's JSON errors and SSE ``error`` events, which are the same servicer's;
a react_loop tool's error result, which both the model and RunTask's ``tool_result`` event read, as react.py
makes it: the model's answer is the caller's to read too). Each address becomes a name that says what it was
without where: a URL in an error the upstream model (or the proxy before it) answered is ``the model server`` (or ``the
proxy``: :data:`UPSTREAM_HOPS`), any other address :data:`HIDDEN`; the status, the server's own words (its key
already redacted) and the fix stay. ``orchestrator.show_addresses_to_callers`` (default false) leaves addresses
in, for a deployment whose callers are its operators; credentials in a URL (``user:password@``) and its query
(``?api-key=...``) are taken out even then.
"""

from __future__ import annotations

import re
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.common.grpc_target import dns_name, static_addresses
from switchyard.common.untrusted import shown as quoted
from switchyard.orchestrator.taskstore.base import OWNER_NAMED

ERROR_EVENT = "switchyard.error"
"""The span event that keeps a message's whole text (``switchyard.error.message``, and the hop that answered it,
``switchyard.error.origin``) where its caller read it with addresses hidden: the span's status carries what the
caller read."""

HIDDEN = "[address hidden]"
"""What an address becomes where nothing names what it was."""

MODEL_SERVER = "the model server"
PROXY = "the proxy"
UPSTREAM_HOPS = frozenset({"upstream model", "proxy"})
"""The hops (``switchyard-error-origin``) whose errors' URLs are named, not only hidden: an upstream model's
error names the model server's URLs (its chat completions, its model list, its metrics: each a path under its
base URL), a proxy's names the proxy (a URL without a path, ``HTTPS_PROXY=http://proxy:3128``) beside the
model server's URL it was calling."""


_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*")
"""A URL with a scheme (``http://``, ``https://``, ``dns:///``, ``unix://``): to the first space or quote."""
_TRAILING = ".,;:!?)]}"
"""Characters that end a sentence or a parenthesis after a URL, not part of it (unless it opened them)."""
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(?:%[\w.]+)?\](?::\d{1,5})?")
"""A bracketed IPv6 address, port optional: ``[fd00::7]:8000``."""
_GRPC_SCHEME = r"(?:ipv4|ipv6|unix|unix-abstract|vsock)"
"""The schemes of gRPC's resolved addresses."""
_GRPC_ADDRESS = re.compile(r"\b" + _GRPC_SCHEME + r":(?!" + re.escape(HIDDEN) + r")[^\s'\",;)]*[^\s'\",;):.]")
"""gRPC's resolved addresses in its words: ``ipv4:10.0.0.5:50053``, ``ipv6:%5B::1%5D:50053``, ``unix:/run/s``."""
_IPV4 = re.compile(r"(?<![\w.-])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?![\w.-])")
"""An IPv4 address, port optional; not within a name (a caller's ``10.0.0.1-report``, ``build-10.0.0.1``)."""
_HOST_PORT = re.compile(r"(?<![\w.:/@-])(?:localhost|(?=[\w.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+):\d{2,5}(?![\w.]|:\d)")
"""A host name with a dot (or ``localhost``) and a port: ``model-a.serving.svc:8000``, ``localhost:8400``. A
name of one label with a port (``vllm-a:8000``) reads as a caller's own id (``user:12345``, ``job:1234``) and
is left, but for the orchestrator's own settings' (:meth:`EdgeText.for_config`) and in an upstream's error
(:data:`_ONE_LABEL_HOST_PORT`)."""
_ONE_LABEL_HOST_PORT = re.compile(r"(?<![\w.:/@'\"`-])(?=[\w-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                                  r":\d{2,5}(?![\w.]|:\d)")
"""A host name of one label with a port (``vllm-a:8000``): an address in an upstream's error, where no caller's
id is named (a model id is quoted: ``'m:1234'``, Ollama's ``"m:1234"``, vLLM's ```m:1234```)."""
_SOCKET_ADDRESS = re.compile(r"""\(\s*(['"])(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*(?:%[\w.]+)?"""
                             r"""|localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)\1"""
                             r"""\s*,\s*\d{1,5}(?:\s*,\s*\d+){0,2}\s*\)""")
"""A socket address as Python prints it, in an OS error's words (asyncio's and aiohttp's ``Connect call failed
('10.0.3.7', 8000)``, an IPv6 one ``('fd00::7', 8000, 0, 0)``): its host and port together, hidden whole (the
IPv4 pattern alone left ``('[address hidden]', 8000)``, the port shown, and an IPv6 host unbracketed, shown)."""
_CLUSTER_NAME = re.compile(r"(?<![\w.-])[A-Za-z0-9][\w-]*(?:\.[\w-]+)*\.(?:svc(?:\.cluster\.local)?|cluster\.local"
                           r"|internal|local|lan|localdomain)\b(?![.-]\w)")
"""A host name of a private network without a port: ``vllm.serving.svc.cluster.local``, ``ip-10-0-3-7.ec2.internal``."""


def _url_end(text: str, start: int, end: int) -> int:
    """Where the URL found at ``text[start:end]`` ends: without a sentence's punctuation after it, nor a closing
    bracket it did not open (``(from http://h:8000/v1)``)."""
    while end > start and text[end - 1] in _TRAILING:
        url = text[start:end]
        closer = text[end - 1]
        opener = {")": "(", "]": "[", "}": "{"}.get(closer)
        if opener is not None and url.count(opener) >= url.count(closer):
            break
        end -= 1
    return end


def _url_name(url: str, hop: str) -> str:
    """What ``url`` is named in an error of ``hop`` (:data:`UPSTREAM_HOPS`): the model server, the proxy (a
    pathless URL in a proxy's error), else :data:`HIDDEN`."""
    if hop not in UPSTREAM_HOPS:
        return HIDDEN
    try:
        pathless = urlsplit(url).path in ("", "/")
    except ValueError:
        return HIDDEN
    return PROXY if hop == "proxy" and pathless else MODEL_SERVER


def without_credentials(url: str) -> str:
    """``url`` without its userinfo (``user:password@``), query and fragment: where credentials ride in a URL.
    A text that does not parse as a URL is :data:`HIDDEN`."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return HIDDEN


def _request_ids_of(task_id_quoted: str) -> re.Pattern[str]:
    """The quoted request ids of a task's model calls (``'<task_id>:<turn>'``, ``:prefill`` for its warm-up, with
    ``~<n>`` where two calls in flight shared one: the orchestrator's ``InferenceClient`` names them so), given the
    task id as ``untrusted.shown`` quotes it."""
    return re.compile(re.escape(task_id_quoted[:-1]) + r":(?:\d+|prefill)(?:~\d+)?" + re.escape(task_id_quoted[-1]))


class EdgeText:
    """Rewrites what leaves the edge for a caller (module docstring): internal addresses hidden, unless
    ``show_addresses`` (``orchestrator.show_addresses_to_callers``), when only URLs' credentials are taken out.

    Args:
        show_addresses: leave addresses in the messages callers read.
        known: addresses hidden as written, besides the patterns' (an orchestrator's own: :meth:`for_config`).
    """

    def __init__(self, show_addresses: bool, known: Iterable[str] = ()) -> None:
        self.show_addresses = show_addresses
        names = sorted({k for k in known if k}, key=len, reverse=True)  # the longest first: a list before its parts
        # gRPC's own words put a scheme before an address (``ipv4:127.0.0.1:50053``): hidden with it, else the
        # scheme was left before the name and read as an address of its own (``[address hidden] hidden]``).
        listed = "|".join(map(re.escape, names))
        self._known = (re.compile(r"(?<![\w.-])(?:" + listed + "|" + _GRPC_SCHEME + r":(?:" + listed + r"))"
                                  r"(?![\w.]|:\d)") if names else None)

    @classmethod
    def for_config(cls, config: SwitchyardConfig) -> "EdgeText":
        """The edge of an orchestrator of ``config``: ``orchestrator.show_addresses_to_callers``, and the addresses
        its own settings name hidden as written, whatever their form (``dispatcher:50053``, a host name of one
        label, which the patterns leave): ``orchestrator.dispatcher_addr`` and ``retrieval_addr`` (each
        address of an ``ipv4:`` list, a ``dns:`` target's name) and the DRAM tier's Redis (``memory.dram``)."""
        orch = config.orchestrator
        known: list[str] = []
        for target in (orch.dispatcher_addr, orch.retrieval_addr):
            known.append(target)
            listed = static_addresses(target)
            known += listed if listed is not None else [dns_name(target) or ""]
        dram = config.memory.dram
        known.append(f"{dram.host}:{dram.port}")
        return cls(orch.show_addresses_to_callers, known)

    def text(self, message: str, hop: str = "", keep: Iterable[str] = ()) -> str:
        """``message`` as its caller reads it. ``hop``: the hop that answered the error (``upstream model``,
        ``proxy``, ``dispatcher``, ...; :data:`UPSTREAM_HOPS` name their URLs); "" where no one hop is known (every
        URL :data:`HIDDEN`). ``keep``: the caller's own values the message quotes (its task_id, agent_id, model,
        as ``untrusted.shown`` quotes them), left as they are where quoted so: an id such as ``run.2024:0001`` or
        ``crawler.internal`` reads as an address to the patterns, and the caller needs it back (an unquoted
        occurrence, such as a downstream address it equals, is still hidden). So are the ids of a kept task id's
        model calls, ``<task_id>:<turn>`` quoted, which the dispatcher's errors name (``errors.request_named``)."""
        marks: dict[str, str] = {}
        if not self.show_addresses:
            kept = {quoted(v) for v in keep if v}
            kept |= {found.group() for v in keep if v for found in _request_ids_of(quoted(v)).finditer(message)}
            for value in sorted(kept, key=len, reverse=True):  # a longer one first
                if value in message:
                    mark = f"'\x00{len(marks)}\x00'"  # quoted: no URL runs into it, and no pattern matches it
                    message = message.replace(value, mark)
                    marks[mark] = value
        shown = self._text(message, hop)
        for mark, value in marks.items():
            shown = shown.replace(mark, value)
        return shown

    def _text(self, message: str, hop: str) -> str:
        """:meth:`text` without ``keep``."""
        out: list[str] = []
        at = 0
        for found in _URL.finditer(message):
            start, end = found.start(), _url_end(message, found.start(), found.end())
            if start < at:
                continue
            out.append(self._bare(message[at:start], hop))
            url = message[start:end]
            out.append(without_credentials(url) if self.show_addresses else _url_name(url, hop))
            at = end
        out.append(self._bare(message[at:], hop))
        return "".join(out)

    def text_kept_on_span(self, message: str, hop: str = "", keep: Iterable[str] = ()) -> str:
        """:meth:`text`, and where it changed ``message``, ``message`` whole on the current span (the call's, or
        the tool's: :data:`ERROR_EVENT`), for the operator."""
        shown = self.text(message, hop, keep)
        if shown != message:
            trace.get_current_span().add_event(ERROR_EVENT, {"switchyard.error.message": message,
                                                             "switchyard.error.origin": hop or "orchestrator"})
        return shown

    def _bare(self, text: str, hop: str) -> str:
        """``text`` (holding no URL) with its bare addresses hidden: IPs, host:port, private host names, an
        orchestrator instance id's host and pid (``orchestrator web-7:4242:3f2a9c1d`` reads ``orchestrator instance
        3f2a9c1d``: the tag, which the operator's logs name beside the whole id); in an error of an upstream hop
        (:data:`UPSTREAM_HOPS`: no caller's id in it), a one-label ``host:port`` too (a pool's endpoint,
        ``vllm-a:8000``)."""
        if self.show_addresses:
            return text
        text = OWNER_NAMED.sub(r"orchestrator instance \g<tag>", text)  # first: its host:pid reads as host:port
        if self._known is not None:
            text = self._known.sub(HIDDEN, text)
        text = _SOCKET_ADDRESS.sub(f"({HIDDEN})", text)
        for pattern in (_GRPC_ADDRESS, _IPV6, _IPV4, _HOST_PORT, _CLUSTER_NAME):
            text = pattern.sub(HIDDEN, text)
        return _ONE_LABEL_HOST_PORT.sub(HIDDEN, text) if hop in UPSTREAM_HOPS else text

    def status(self, status: agent_pb2.TaskStatus) -> agent_pb2.TaskStatus:
        """A task's status as its caller reads it: its ``error`` (``CODE: message``, as the task store holds
        it) through :meth:`text`, the task's own id kept where quoted; ``status`` itself where nothing changes,
        else a copy (the store's and this process's records keep the whole message)."""
        if not status.error:
            return status
        relayed = _RELAYED.match(status.error)
        shown = self.text(status.error, relayed.group("hop") if relayed else "",
                          keep=[status.task_id])  # the caller's own id, where quoted
        if shown == status.error:
            return status
        copy = agent_pb2.TaskStatus()
        copy.CopyFrom(status)
        copy.error = shown
        return copy


_RELAYED = re.compile(r"^[A-Z_]+: (?P<hop>[a-z][a-z ]*) \(via ")
"""A stored error (``CODE: message``) a downstream service relayed from the hop that answered it, as the
orchestrator words it (``upstream model (via dispatcher at ADDRESS): ...``: clients.py ``_hop_error``)."""
