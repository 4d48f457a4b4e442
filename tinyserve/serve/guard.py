"""The door: what a request must show before the app sees it, and how long its body may take.

``Guard`` is ASGI middleware in front of every route. In order, each refusal in OpenAI's error body:

1. Content-Length together with Transfer-Encoding: a 400, and the connection is closed. h11
   would go by Transfer-Encoding, a proxy in front might go by Content-Length, and the bytes
   they disagree on would be read as a second, smuggled request.
2. A ``Host`` that is not the address the connection came in on, a loopback name or one given
   with ``--allowed-host``: a 400. A page on evil.example whose name is rebound to 127.0.0.1
   (DNS rebinding) reaches this server with ``Host: evil.example``; refusing it keeps the page
   from reading any answer.
3. Without ``Authorization: Bearer <key>`` when an API key is set: a 401. Only ``/health``,
   ``/metrics`` and (when enabled) the docs are open.
4. A body that is not ``application/json``: a 415. Forms, multipart and text/plain are what a
   web page may POST to any address without asking first (no CORS preflight); JSON needs one,
   which this server never grants.

Then the body must arrive within ``body_timeout_s`` of the request head: ``receive`` is wrapped,
and a body still incomplete at the deadline is answered with a 408 and the connection closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyserve.serve.bodies import APIError
from tinyserve.serve.settings import ServerSettings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed, as in vLLM
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
CLOSE = {"connection": "close"}


class BodyTimeout(Exception):
    """The request's body was not complete by its deadline (raised from the wrapped ``receive``)."""


def host_name(value: str) -> str:
    """The name part of a Host header or an address, lowercased: ``[::1]:8000`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal, with or without a port
        return value[1:value.index("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")  # "localhost." is the same name


def header_values(scope: Scope, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope["headers"] if k == name]


def has_body(scope: Scope) -> bool:
    lengths = header_values(scope, b"content-length")
    return bool(header_values(scope, b"transfer-encoding")) or any(v.strip() not in ("", "0") for v in lengths)


def digest(text: str) -> bytes:
    # Compared as digests so that the comparison takes the same time whatever the key's length.
    return hashlib.sha256(text.encode()).digest()


class Guard:
    """ASGI middleware refusing what the module docstring lists, then timing the request's body."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self.allowed_hosts = frozenset(host_name(h) for h in settings.allowed_hosts) | LOOPBACK_NAMES
        self.key_digest = digest(settings.api_key) if settings.api_key else None
        self.open_paths = OPEN_PATHS | (DOCS_PATHS if settings.enable_docs else frozenset())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            error, headers = refusal
            await error.response(headers=headers)(scope, receive, send)
            return
        await self.timed_body(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[APIError, dict | None] | None:
        """The error this request gets before the app sees it (and its headers), or None."""
        if header_values(scope, b"content-length") and header_values(scope, b"transfer-encoding"):
            return APIError("A request may not carry both Content-Length and Transfer-Encoding.",
                            code="ambiguous_body_length"), CLOSE
        hosts = header_values(scope, b"host")
        if len(hosts) > 1 or (hosts and not self.host_allowed(hosts[0], scope)):
            return APIError(f"The Host header {hosts[0]!r} does not name this server; start it with "
                            "--allowed-host to accept that name.", param="Host", code="invalid_host"), None
        if self.key_digest is not None and scope["path"] not in self.open_paths and not self.key_matches(scope):
            return APIError("Incorrect API key provided: send it as 'Authorization: Bearer <key>'.", status=401,
                            code="invalid_api_key"), {"www-authenticate": "Bearer"}
        if has_body(scope):
            types = header_values(scope, b"content-type")
            media = types[0].split(";")[0].strip().lower() if len(types) == 1 else ""
            if media != "application/json":
                return APIError(f"The request body must be application/json, not {types[0]!r}." if types else
                                "The request body must be application/json, and say so in Content-Type.",
                                param="Content-Type", status=415, code="unsupported_media_type"), None
        return None

    def host_allowed(self, host: str, scope: Scope) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = host_name(host)
        server = scope.get("server")
        return name in self.allowed_hosts or (server is not None and name == host_name(str(server[0])))

    def key_matches(self, scope: Scope) -> bool:
        values = header_values(scope, b"authorization")
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(digest(token.strip()), self.key_digest)

    async def timed_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a ``receive`` that raises ``BodyTimeout`` once the body is late."""
        loop = asyncio.get_running_loop()
        timeout = self.settings.body_timeout_s
        deadline = loop.time() + timeout
        body_done, response_started = False, False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:  # later calls wait for a disconnect, for as long as the answer takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimeout from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_noting_start(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_in_time, send_noting_start)
        except BodyTimeout:
            if response_started:  # too late to answer: uvicorn closes the connection
                raise
            error = APIError(f"The request body did not arrive within {timeout:g} s.", status=408,
                             code="request_timeout")
            await error.response(headers=CLOSE)(scope, receive, send)
