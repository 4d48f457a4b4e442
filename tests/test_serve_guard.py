"""The server against a hostile client: late requests, floods, Ctrl-C, access control, HTTP edges.

In-process servers (``ServerThread``, each with its own ``ServerSettings``) share one engine over
the session's tiny model, one at a time; one ``python -m tinyserve.serve`` subprocess is flooded
with idle connections under a low descriptor limit, then interrupted while requests are open.
Everything is on loopback, every wait has a bound, and every server is stopped.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from cli_serving import free_port, wait_until_serving
from fastapi import Request

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.serve import ServerSettings, ServerThread, create_app
from tinyserve.serve.connections import TimedH11Protocol
from tinyserve.serve.floodlog import FloodFilter, install
from tinyserve.worker import Worker

COMPLETION = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_loaded) -> LLMEngine:
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=64, num_cpu_blocks=8),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))


@contextmanager
def serving(engine: LLMEngine, routes=None, **settings):
    """A server for ``engine`` with these settings; ``routes(app)`` may add test-only routes first."""
    app = create_app(engine, model_name="tiny", settings=ServerSettings(**settings))
    if routes is not None:
        routes(app)
    with ServerThread(app) as server:
        yield server


def connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def head(method: str, path: str, *lines: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *lines, "", ""]).encode()


def read_to_eof(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (which it must do in time)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def closing_times(socks: dict[str, socket.socket], t0: float, timeout: float) -> dict[str, tuple[float, bytes]]:
    """When (after t0) the server closed each connection, and what it sent before."""
    open_, done, data = dict(socks), {}, {name: b"" for name in socks}
    while open_:
        left = t0 + timeout - time.monotonic()
        assert left > 0, f"still open after {timeout} s: {sorted(open_)}"
        readable, _, _ = select.select(list(open_.values()), [], [], left)
        for name, sock in list(open_.items()):
            if sock in readable:
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    data[name] += chunk
                else:
                    done[name] = (time.monotonic() - t0, data[name])
                    del open_[name]
    return done


def error_body(data: bytes) -> dict:
    return json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]


# -- 1. late heads and bodies are closed; the others are served ------------------------------------

def test_late_heads_and_bodies_are_closed_in_time_while_a_normal_request_succeeds(engine):
    """Each timer is checked from both sides: not before its time (so it is the timer that closed
    the connection), and within a second or two after it."""
    with serving(engine, header_timeout_s=1.0, body_timeout_s=1.5, keep_alive_timeout_s=1.0) as server:
        t0 = time.monotonic()  # before connecting, so that no timer starts before it
        socks = {name: connect(server) for name in ("idle", "half head", "trickled head", "half body",
                                                    "unread body", "keep-alive")}
        socks["half head"].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        socks["trickled head"].sendall(head("GET", "/health").removesuffix(b"\r\n\r\n") + b"\r\nX-Slow: ")
        socks["half body"].sendall(head("POST", "/v1/completions", "Content-Type: application/json",
                                        "Content-Length: 200") + b'{"model": "tiny", ')
        # Answered at once (a 404), but the rest of its body would never come.
        socks["unread body"].sendall(head("POST", "/v1/nothing", "Content-Type: application/json",
                                          "Content-Length: 200") + b'{"model": ')
        socks["keep-alive"].sendall(head("GET", "/health"))
        stop = threading.Event()

        def trickle() -> None:  # a byte every 0.2 s must not keep a connection open (slowloris)
            while not stop.wait(0.2):
                for name in ("trickled head", "unread body"):
                    try:
                        socks[name].send(b"a")
                    except OSError:
                        pass

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        try:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                r = client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            closed = closing_times(socks, t0, timeout=10)
        finally:
            stop.set()
            trickler.join(5)
            for sock in socks.values():
                sock.close()
    for name in ("idle", "half head", "trickled head"):
        assert 0.9 <= closed[name][0] <= 3.0, (name, closed[name])
        assert closed[name][1] == b""
    when, data = closed["half body"]  # the app was waiting for it: a 408, then the connection closes
    assert 1.4 <= when <= 3.5 and data.startswith(b"HTTP/1.1 408 "), closed["half body"]
    assert error_body(data)["code"] == "request_timeout" and b"connection: close" in data.lower()
    when, data = closed["unread body"]  # 1.5 s and the protocol's second of grace
    assert 2.4 <= when <= 5.0 and data.startswith(b"HTTP/1.1 404 "), closed["unread body"]
    when, data = closed["keep-alive"]  # answered, then idle: uvicorn's keep-alive timeout
    assert 0.9 <= when <= 3.0 and data.startswith(b"HTTP/1.1 200 "), closed["keep-alive"]


def test_a_request_head_after_an_idle_keep_alive_is_timed_from_its_first_byte(engine):
    # The keep-alive timeout is far from the idle time, so a busy machine cannot close the
    # connection before the next head starts; a clock started anywhere else would close at 0 s
    # (from the last answer) or at 2.5 s (the keep-alive's).
    with serving(engine, header_timeout_s=1.0, keep_alive_timeout_s=4.0) as server, connect(server) as sock:
        sock.sendall(head("GET", "/health"))
        sock.settimeout(5)
        answer = sock.recv(65536)
        while not answer.endswith(b'{"status":"ok"}'):  # the body may come in a segment of its own
            chunk = sock.recv(65536)
            assert chunk, answer  # closed before the whole answer came
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 ")
        time.sleep(1.5)  # idle, within the keep-alive timeout
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        t0 = time.monotonic()
        closed = closing_times({"next head": sock}, t0, timeout=6)
    assert 0.9 <= closed["next head"][0] <= 2.4 and closed["next head"][1] == b""


def test_past_max_connections_requests_get_a_503_until_connections_close(engine):
    with serving(engine, max_connections=3) as server:
        idle = [connect(server) for _ in range(3)]
        try:
            time.sleep(0.2)  # accepted
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503  # 3 idle + this one
            idle.pop().close()
            deadline = time.monotonic() + 10
            while (status := httpx.get(f"{server.url}/health", timeout=10).status_code) != 200:
                assert status == 503 and time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            for sock in idle:
                sock.close()


# -- the flood is logged once, not once per connection ---------------------------------------------

def resource_record(logger: str = "asyncio") -> logging.LogRecord:
    exc = OSError(errno.EMFILE, "Too many open files")
    return logging.LogRecord(logger, logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                             (), (OSError, exc, None))


def test_the_flood_filter_passes_one_record_a_window_and_counts_the_rest():
    now = [0.0]
    flood = FloodFilter(window_s=10.0, clock=lambda: now[0])
    passed = [r for r in (resource_record() for _ in range(1000)) if flood.filter(r)]
    assert len(passed) == 1
    now[0] = 5.0
    assert not flood.filter(resource_record())
    assert flood.filter(resource_record("uvicorn.error"))  # another logger: another kind
    warning = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "Exceeded concurrency limit.", (), None)
    assert flood.filter(warning) and not flood.filter(warning)
    ordinary = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (), None)
    assert all(flood.filter(ordinary) for _ in range(100))  # everything else passes untouched
    now[0] = 10.5
    record = resource_record()
    assert flood.filter(record) and "1000 more like this" in record.getMessage()
    # The retries accept() left behind, each failing once the listening socket is closed.
    retries = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Exception in callback %s", (
        "BaseSelectorEventLoop._start_serving(<function>, <socket>, None, <Server sockets=()>, 2048)",),
        (ValueError, ValueError("Invalid file descriptor: -1"), None)) for _ in range(2048)]
    assert sum(flood.filter(r) for r in retries) == 1


def test_asyncio_accept_errors_reach_the_installed_filter_once():
    """The record asyncio's accept loop really makes (EMFILE, once per connection in the backlog)
    is the one the filter catches; ``install`` is idempotent."""
    install()
    install()
    logger = logging.getLogger("asyncio")
    assert sum(isinstance(f, FloodFilter) for f in logger.filters) == 1
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Collect()
    logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    try:
        with socket.socket() as sock:
            for _ in range(200):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files"),
                                             "socket": sock})
    finally:
        loop.close()
        logger.removeHandler(handler)
    assert len([r for r in seen if "out of system resource" in r.getMessage()]) == 1


# -- 2 and 1, end to end: python -m tinyserve.serve flooded, then interrupted ------------------------

@pytest.fixture(scope="module")
def cli_server(tiny_model_dir, tmp_path_factory):
    """(process, port, log path) of ``python -m tinyserve.serve`` with a 1 s header timeout."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("cli") / "server.log"
    with open(log_path, "w") as out:  # a file, not a pipe: a flood must not block the server on a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "tinyserve.serve", "--port", str(port), "--model",
                                 str(tiny_model_dir), "--device", "cpu", "--max-model-len", "512",
                                 "--num-gpu-blocks", "64", "--header-timeout", "1", "--body-timeout", "120",
                                 "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, port, log_path.read_text)
        yield proc, port, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.skipif(not (hasattr(resource, "prlimit") and os.path.isdir("/proc/self/fd")), reason="Linux only")
def test_out_of_descriptors_the_flood_is_logged_once_and_a_normal_request_gets_through(cli_server):
    proc, port, log_path = cli_server
    limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 4, limits[1]))  # room for 4 connections
    idle = []
    try:
        for _ in range(12):  # the kernel queues what the server cannot accept
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        t0 = time.monotonic()
        # Served once the idle connections ahead of it have timed out, 4 at a time.
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 < 20
        closed = closing_times(dict(enumerate(idle)), t0, timeout=20)  # every one, by the server
        assert all(data == b"" for _, data in closed.values())
    finally:
        for sock in idle:
            sock.close()
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
    log = log_path.read_text()
    # accept() failed over and over (once per try, 2,048 tries a round); the log says so once.
    assert 1 <= log.count("out of system resource") <= 2, log[-3000:]
    assert len(log) < 200_000


def test_ctrl_c_finishes_with_a_half_sent_body_and_an_unread_stream_open(cli_server):
    proc, port, log_path = cli_server
    half = socket.create_connection(("127.0.0.1", port), timeout=10)
    stream = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        half.sendall(head("POST", "/v1/completions", "Content-Type: application/json", "Content-Length: 1000")
                     + b'{"prompt": "Hello')  # the body timeout is 120 s: only the shutdown timeout ends it
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True})
        stream.sendall(head("POST", "/v1/completions", "Content-Type: application/json",
                            f"Content-Length: {len(body)}") + body.encode())
        assert stream.recv(65536).startswith(b"HTTP/1.1 200 ")  # streaming, and never read again
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 30
    finally:
        half.close()
        stream.close()
    log = log_path.read_text()
    # The half-sent body (and the stream, if still running): the shutdown timeout ended them, not the clients.
    assert re.search(r"Cancel [12] running task", log)
    # After the flood above, shutting down fails each retry accept() left behind; logged once too.
    assert log.count("Traceback") <= 5 and len(log) < 100_000, log[-3000:]


def test_the_open_file_limit_is_raised_to_fit_max_connections_or_a_warning_says_why(monkeypatch):
    from tinyserve.serve.connections import OPEN_FILES_HEADROOM, fit_open_files

    limits = {"soft": 256, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(resource, "setrlimit", lambda which, new: limits.update(soft=new[0], hard=new[1]))
    assert fit_open_files(256) is None and limits == {"soft": 256 + OPEN_FILES_HEADROOM, "hard": 4096}
    assert fit_open_files(100) is None and limits["soft"] == 256 + OPEN_FILES_HEADROOM  # never lowered
    limits.update(soft=256, hard=256)  # `ulimit -n 256` sets both
    warning = fit_open_files(256)
    assert warning and "--max-connections 256" in warning and limits == {"soft": 256, "hard": 256}


# -- 3. access control ---------------------------------------------------------------------------

def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["message"]


def test_an_api_key_guards_every_v1_path_but_health_and_metrics_stay_open(engine):
    with serving(engine, api_key="s3cret") as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert_refused(client.get("/v1/models"), 401, "invalid_api_key")
        assert_refused(client.post("/v1/completions", json=COMPLETION), 401, "invalid_api_key")
        for wrong in ["Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret", "Bearer", "Bearer S3CRET"]:
            r = client.get("/v1/models", headers={"Authorization": wrong})
            assert_refused(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        key = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=key).status_code == 200
        r = client.post("/v1/completions", json=COMPLETION, headers=key)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("kind", ["text/plain", "form", "multipart", "no content-type"])
def test_bodies_that_are_not_json_get_a_415(engine, kind):
    payload = json.dumps(COMPLETION)
    request = {"text/plain": {"content": payload, "headers": {"content-type": "text/plain"}},
               "form": {"data": {"prompt": "Hello"}},
               "multipart": {"files": {"prompt": ("p.json", payload, "application/json")}},
               "no content-type": {"content": payload}}[kind]
    with serving(engine) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert_refused(client.post("/v1/completions", **request), 415, "unsupported_media_type")
        r = client.post("/v1/completions", content=payload, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200


def test_a_host_header_naming_another_server_is_refused(engine):
    with serving(engine, allowed_hosts=("api.example",)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        for bad in ["evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "localhost.evil"]:
            r = client.post("/v1/completions", json=COMPLETION, headers={"Host": bad})
            assert_refused(r, 400, "invalid_host")
        for good in [f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST", f"[::1]:{server.port}",
                     "api.example", "api.example:443"]:
            assert client.get("/v1/models", headers={"Host": good}).status_code == 200, good
        assert_refused(client.get("/health", headers={"Host": "evil.example"}), 400, "invalid_host")


def test_docs_are_served_only_when_enabled(engine):
    with serving(engine) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ["/docs", "/redoc", "/openapi.json"]:
            assert client.get(path).status_code == 404
    with serving(engine, enable_docs=True, api_key="k") as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/docs").status_code == 200 and "swagger" in client.get("/docs").text.lower()
        assert client.get("/redoc").status_code == 200
        assert "/v1/completions" in client.get("/openapi.json").json()["paths"]


# -- 5. HTTP edges -------------------------------------------------------------------------------

def test_content_length_with_transfer_encoding_is_a_400_and_the_connection_closes(engine):
    """h11 itself would accept it (and go by Transfer-Encoding); the smuggled request after the
    chunked body is never answered."""
    with serving(engine) as server, connect(server) as sock:
        sock.sendall(head("POST", "/v1/completions", "Content-Type: application/json", "Content-Length: 4",
                          "Transfer-Encoding: chunked") + b"0\r\n\r\n" + head("GET", "/v1/models"))
        data = read_to_eof(sock)
    assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1 ") == 1
    assert error_body(data)["code"] == "ambiguous_body_length"


def whoami(app) -> None:
    @app.get("/whoami")
    async def who(request: Request) -> dict:
        return {"client": request.client.host}


@pytest.mark.parametrize("trust", [False, True])
def test_x_forwarded_for_is_ignored_unless_trusted(engine, trust):
    with serving(engine, routes=whoami, trust_forwarded_for=trust) as server:
        r = httpx.get(f"{server.url}/whoami", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=10)
    assert r.json()["client"] == ("203.0.113.9" if trust else "127.0.0.1")


def test_head_health_is_a_200_without_a_body(engine):
    with serving(engine) as server, connect(server) as sock:
        sock.sendall(head("HEAD", "/health", "Connection: close"))
        data = read_to_eof(sock)
    status, rest = data.split(b"\r\n", 1)
    assert status == b"HTTP/1.1 200 OK" and rest.endswith(b"\r\n\r\n") and rest.count(b"\r\n\r\n") == 1


# -- 4. the command line checks its flags before the model loads ------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    from tinyserve.serve import cli

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "LLM", fail)
    return cli


def ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@pytest.mark.parametrize("argv,flag", [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--port", "http"], "--port"),
    (["--log-level", "nonsense"], "--log-level"),
    (["--swap-space", "1e12"], "--swap-space"), (["--swap-space", f"{ram_gib() * 1.5:.0f}"], "--swap-space"),
    (["--block-size", "0"], "--block-size"), (["--num-gpu-blocks", "-3"], "--num-gpu-blocks"),
    (["--max-num-seqs", "0"], "--max-num-seqs"), (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-connections", "0"], "--max-connections"), (["--header-timeout", "0"], "--header-timeout"),
    (["--body-timeout", "-1"], "--body-timeout"), (["--keep-alive-timeout", "nan"], "--keep-alive-timeout"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"), (["--api-key", ""], "--api-key"),
    (["--allowed-host", "http://example.com/"], "--allowed-host"),
])
def test_bad_flags_fail_before_the_model_loads_naming_the_flag(no_model, capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        no_model.main(argv)
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_flags_reach_the_settings_and_uvicorn(monkeypatch):
    from tinyserve.serve import cli

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            self.engine = "engine"

    monkeypatch.setattr(cli, "LLM", FakeLLM)
    monkeypatch.setattr(cli, "create_app", lambda engine, name, settings: seen.update(settings=settings) or "app")
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kw: seen.update(app=app, uvicorn=kw))
    monkeypatch.setenv("TINYSERVE_API_KEY", "from-env")
    cli.main(["--host", "localhost", "--allowed-host", "a.example", "--allowed-host", "b.example", "--enable-docs",
              "--trust-forwarded-for", "--max-connections", "7", "--header-timeout", "2", "--body-timeout", "3",
              "--keep-alive-timeout", "4", "--shutdown-timeout", "5", "--log-level", "WARNING",
              "--stall-timeout", "6", "--max-messages", "8", "--special-tokens-in-content"])
    assert seen["settings"] == ServerSettings(api_key="from-env", allowed_hosts=("a.example", "b.example", "localhost"),
                                              trust_forwarded_for=True, enable_docs=True, max_connections=7,
                                              header_timeout_s=2, body_timeout_s=3, keep_alive_timeout_s=4,
                                              shutdown_timeout_s=5, stall_timeout_s=6, max_messages=8,
                                              special_tokens_in_content=True)
    kw = seen["uvicorn"]
    # uvicorn counts the connection asking among the open ones: 8 lets 7 in (test_serve_body_stall.py).
    assert (kw["limit_concurrency"], kw["timeout_keep_alive"], kw["timeout_graceful_shutdown"]) == (8, 4, 5)
    assert kw["proxy_headers"] is True and kw["log_level"] == "warning" and kw["host"] == "localhost"
    protocol = kw["http"]
    assert issubclass(protocol, TimedH11Protocol)
    assert (protocol.header_timeout_s, protocol.body_timeout_s, protocol.stall_timeout_s) == (2, 3, 6)
    cli.main(["--api-key", "flag"])  # the flag wins over the environment; by default nothing is trusted
    assert seen["settings"].api_key == "flag" and seen["uvicorn"]["proxy_headers"] is False
    monkeypatch.delenv("TINYSERVE_API_KEY")
    defaults = cli.parser().parse_args([])
    assert cli.server_settings(defaults) == ServerSettings(allowed_hosts=("127.0.0.1",))
