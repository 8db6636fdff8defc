"""CORS on the HTTP face (orchestrator.http.cors_allowed_origins, aiohttp-cors): preflights as a browser sends them
before a dashboard's fetch, and the actual requests after them, against the real aiohttp server on 127.0.0.1 port
0; an SSE stream read by httpx-sse with the Origin a page's fetch carries."""

from __future__ import annotations

import pytest
from httpx_sse import aconnect_sse
from test_http_face import FIELD_BODY, http_stack

from switchyard.common.config import load_config

pytestmark = pytest.mark.no_gpu

DASHBOARD = "https://dash.example.com"
ALLOWED = {"orchestrator.http.cors_allowed_origins": [DASHBOARD]}
CHAT = {**FIELD_BODY, "task_type": "chat"}


def _preflight(origin: str, method: str, headers: str = "") -> dict[str, str]:
    """The headers of a browser's preflight (Fetch standard, 4.8: CORS-preflight fetch)."""
    sent = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        sent["Access-Control-Request-Headers"] = headers
    return sent


async def test_without_allowed_origins_there_are_no_cors_headers_and_options_is_405():
    async with http_stack() as (client, _, down):
        preflight = await client.options("/api/v1/agent/run", headers=_preflight(DASHBOARD, "POST", "content-type"))
        assert preflight.status_code == 405 and preflight.json()["error"]["code"] == "UNIMPLEMENTED"
        for reply in (await client.get("/healthz", headers={"Origin": DASHBOARD}),
                      await client.post("/api/v1/agent/submit", json=CHAT, headers={"Origin": DASHBOARD})):
            assert reply.status_code == 200
            assert not [name for name in reply.headers if name.lower().startswith("access-control-")], reply.headers


async def test_a_dashboard_of_an_allowed_origin_is_preflighted_then_streams_a_run_it_can_read():
    async with http_stack(**ALLOWED) as (client, _, down):
        # what a page's fetch(POST, JSON body, a bearer token, the agent header) makes the browser ask first
        preflight = await client.options("/api/v1/agent/run", headers=_preflight(
            DASHBOARD, "POST", "content-type,authorization,x-agent-id,last-event-id"))
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["Access-Control-Allow-Origin"] == DASHBOARD
        assert preflight.headers["Access-Control-Allow-Methods"] == "POST"
        assert {h.strip().lower() for h in preflight.headers["Access-Control-Allow-Headers"].split(",")} == {
            "content-type", "authorization", "x-agent-id", "last-event-id"}
        assert int(preflight.headers["Access-Control-Max-Age"]) > 0
        assert "Origin" in preflight.headers["Vary"]
        assert down.requests == []  # a preflight runs nothing

        async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=CHAT,
                                headers={"Origin": DASHBOARD}) as source:
            assert source.response.headers["Access-Control-Allow-Origin"] == DASHBOARD
            assert "Origin" in source.response.headers["Vary"]
            kinds = [event.event async for event in source.aiter_sse()]
        assert kinds[0] == "accepted" and kinds[-1] == "final"

        # an error answer is readable by the page too, its Retry-After and WWW-Authenticate exposed
        refused = await client.post("/api/v1/agent/submit", json={**CHAT, "priority": "urgent"},
                                    headers={"Origin": DASHBOARD})
        assert refused.status_code == 400 and refused.headers["Access-Control-Allow-Origin"] == DASHBOARD
        exposed = {h.strip().lower() for h in refused.headers["Access-Control-Expose-Headers"].split(",")}
        assert {"retry-after", "www-authenticate"} <= exposed
        status = await client.options("/api/v1/tasks/t-1", headers=_preflight(DASHBOARD, "GET", "authorization"))
        assert status.status_code == 200 and status.headers["Access-Control-Allow-Methods"] == "GET"


@pytest.mark.parametrize("origin, method, headers, refusal", [
    ("https://elsewhere.example", "POST", "content-type", "origin 'https://elsewhere.example' is not allowed"),
    (DASHBOARD, "DELETE", "", "request method 'DELETE' is not allowed"),  # no route takes DELETE there
    (DASHBOARD, "POST", "content-type,x-not-ours", "headers are not allowed: X-NOT-OURS"),
])
async def test_a_preflight_the_allow_list_refuses_is_403_in_the_error_shape_and_runs_nothing(
        origin, method, headers, refusal):
    async with http_stack(**ALLOWED) as (client, _, down):
        reply = await client.options("/api/v1/agent/run", headers=_preflight(origin, method, headers))
        assert reply.status_code == 403 and "Access-Control-Allow-Origin" not in reply.headers
        error = reply.json()["error"]
        assert error["code"] == "PERMISSION_DENIED" and refusal in error["message"], error
        actual = await client.post("/api/v1/agent/submit", json=CHAT, headers={"Origin": "https://elsewhere.example"})
        assert actual.status_code == 200 and "Access-Control-Allow-Origin" not in actual.headers
        assert len(down.requests) <= 1  # the submit, never the preflight


async def test_a_preflight_needs_no_bearer_token_and_a_refused_call_is_readable_by_the_page(tmp_path):
    """A browser sends no Authorization with a preflight (Fetch standard: a preflight carries no credentials): the
    face's bearer tokens must not refuse it; the actual call without a token is 401, which the page can read."""
    path = tmp_path / "tokens"
    path.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**ALLOWED, **auth) as (client, _, down):
        preflight = await client.options("/api/v1/agent/submit", headers=_preflight(
            DASHBOARD, "POST", "content-type,authorization"))
        assert preflight.status_code == 200 and preflight.headers["Access-Control-Allow-Origin"] == DASHBOARD
        missing = await client.post("/api/v1/agent/submit", json=CHAT, headers={"Origin": DASHBOARD})
        assert missing.status_code == 401 and missing.headers["Access-Control-Allow-Origin"] == DASHBOARD
        assert "www-authenticate" in missing.headers["Access-Control-Expose-Headers"].lower()
        ok = await client.post("/api/v1/agent/submit", json=CHAT,
                               headers={"Origin": DASHBOARD, "Authorization": "Bearer tok-full-1"})
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == DASHBOARD


@pytest.mark.parametrize("origin", ["https://Dash.example.com", "https://dash.example.com/", "dash.example.com",
                                    "https://dash.example.com/app", "",
                                    # a browser leaves a scheme's default port out of Origin, writes a port without
                                    # leading zeros, and has none past 65535: such an entry matched no request
                                    "https://dash.example.com:443", "http://dash.example.com:80",
                                    "https://dash.example.com:08443", "https://dash.example.com:70000"])
def test_an_origin_no_browser_sends_is_refused_at_load_naming_the_key(origin):
    with pytest.raises(Exception) as refused:
        load_config("config", service="orchestrator").with_overrides(
            **{"orchestrator.http.cors_allowed_origins": [origin]})
    assert "orchestrator.http.cors_allowed_origins" in str(refused.value) and "scheme://host" in str(refused.value)


async def test_a_page_may_send_a_compressed_body_the_face_reads():
    """The face reads a body in a Content-Encoding (gzip, deflate, br); a page that compresses its body (a
    CompressionStream) names that header in its preflight, which was refused 403 ('headers are not allowed')."""
    import gzip
    import json

    async with http_stack(**ALLOWED) as (client, _, down):
        preflight = await client.options("/api/v1/agent/submit", headers=_preflight(
            DASHBOARD, "POST", "content-type,content-encoding"))
        assert preflight.status_code == 200, preflight.text
        assert "content-encoding" in preflight.headers["Access-Control-Allow-Headers"].lower()
        sent = await client.post("/api/v1/agent/submit", content=gzip.compress(json.dumps(CHAT).encode()),
                                 headers={"Origin": DASHBOARD, "Content-Type": "application/json",
                                          "Content-Encoding": "gzip"})
        assert sent.status_code == 200 and sent.headers["Access-Control-Allow-Origin"] == DASHBOARD, sent.text
