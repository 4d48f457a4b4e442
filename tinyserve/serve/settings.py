"""The server's own settings: what it protects, how long it waits, how much it takes.

The engine's settings (blocks, budgets, the model) live in ``tinyserve.config``; these are the
HTTP side's, one frozen dataclass that ``create_app`` and ``ServerThread`` take and that the
command line fills in (``cli``). Every default is a bound a hostile client cannot push past:
no connection waits forever, no request grows without limit, nothing is open to the web page
a user happens to visit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server's limits and protections (``docs/serving.md`` lists them)."""

    # Access control.
    api_key: str | None = None  # when set, every /v1/* request needs "Authorization: Bearer <key>"
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides the bound address and loopback names
    trust_forwarded_for: bool = False  # read X-Forwarded-For (only behind a proxy that sets it)
    enable_docs: bool = False  # /docs and /redoc load scripts from a CDN: off unless asked
    # Connections.
    max_connections: int = 256  # connections served at once; more get a 503
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    body_timeout_s: float = 30.0  # ...and its body within this, once the headers are in
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    shutdown_timeout_s: float = 10.0  # Ctrl-C waits this long for open requests, then cancels them
    # Responses.
    stall_timeout_s: float = 30.0  # an answer its client has not read for this long is aborted or cut off
    # Chat requests.
    max_messages: int = 1024  # messages in one chat request
    special_tokens_in_content: bool = False  # True: "<|im_start|>" in content is a control token (vLLM's way)
