"""A client that stops reading its stream (issue 21): the server must not grow, must free the
request, and must go on serving everyone else.

Such a client once took a server from 2.5 GB to 6.5 GB in 205 s: every step queued a copy of
every sequence's whole output for a reader who never came. Here a raw socket asks for 16 samples
of 2,000 tokens and reads nothing, with small socket buffers on both ends so that the server's
writes back up after a few steps (a real client needs only a few more megabytes of stream to get
there). The server must abort it once a write has waited ``stall_timeout_s``, close its
connection, keep its own memory flat, and answer other requests on time meanwhile.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil
import pytest
import uvicorn

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.models.loader import load_model
from tinyserve.models.tiny import make_tiny_model_dir
from tinyserve.serve import ServerSettings, create_app

STALL_S = 2.0
N, MAX_TOKENS = 16, 2000
BOUND_S = 40.0  # the stalled request must be gone, and every other answer in, by then
RSS_BOUND = 150 * 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(engine, url): the tiny Llama with a 2,048-token context, on a socket with a small send buffer."""
    import torch

    from tinyserve.worker import Worker

    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=2048)
    loaded = load_model(path, device="cpu", dtype=torch.float32)
    mc = ModelConfig(model=str(path), device="cpu", dtype="float32")
    engine = LLMEngine(mc, CacheConfig(block_size=16, num_gpu_blocks=N * 2048 // 16 + 64, num_cpu_blocks=16),
                       SchedulerConfig(max_num_seqs=N + 8, max_model_len=2048),
                       executor=Worker(mc, attention_backend="torch", loaded=loaded))
    app = create_app(engine, model_name="tiny", settings=ServerSettings(stall_timeout_s=STALL_S))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)


def stalled_stream(url: str) -> socket.socket:
    """Send a streamed request for N x MAX_TOKENS tokens, and never read the answer."""
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "n": N, "max_tokens": MAX_TOKENS,
                       "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting, so the window stays small
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_a_stalled_reader_is_aborted_while_memory_stays_flat_and_others_finish(server):
    engine, url = server
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    tokens_before = engine.num_generation_tokens_total
    client = stalled_stream(url)
    try:
        t0 = time.monotonic()
        while not engine.has_unfinished_requests():  # it has started
            assert time.monotonic() - t0 < 20, "the stalled request never started"
            time.sleep(0.01)
        # Others are served on time while it stalls.
        peak = rss_before
        with httpx.Client(base_url=url, timeout=BOUND_S) as other:
            for i in range(3):
                start = time.monotonic()
                r = other.post("/v1/completions", json={"model": "tiny", "prompt": f"Request {i}", "max_tokens": 8,
                                                         "temperature": 0, "stream": i == 1})
                assert r.status_code == 200 and time.monotonic() - start < 10
                peak = max(peak, proc.memory_info().rss)
        while engine.has_unfinished_requests():
            assert time.monotonic() - t0 < BOUND_S, "the stalled request was never aborted"
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.05)
        # Aborted well before it could finish: it stopped when its client stopped reading.
        generated = engine.num_generation_tokens_total - tokens_before
        assert generated < N * MAX_TOKENS // 2, generated
        assert peak - rss_before < RSS_BOUND, (peak - rss_before) / 2**20
        # Its connection is closed: what was buffered drains, then EOF.
        client.settimeout(10)
        while client.recv(1 << 16):
            pass
    finally:
        client.close()
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks and not bm.block_tables
