"""Latency under load, through the real server: ``python -m tinyserve.serve`` driven by guidellm.

For each scheduler policy the script starts the server itself (``python -m tinyserve.serve`` on
127.0.0.1, a free port, the default model or ``--model DIR``), waits for ``/health`` (bounded),
sends one warm-up request shaped as guidellm sends them, then runs **guidellm** (the
OpenAI-compatible serving benchmark of vLLM's ecosystem, in its own environment
``.venv-guidellm``, ``make serving-bench``) against it, and stops the server whatever happens.

- Policies: ``vllm`` (v0.4's: prefill first, no mixing), ``orca`` (prefills join decode
  rounds), ``v1`` (one token budget, chunked prefill and prefix caching on, as vLLM V1's
  defaults) where this checkout has it, and ``vllm-chunked`` (v0.4's policy with chunked prefill).
- Workload: guidellm's seeded synthetic text (``--seed``), prompts of PROMPT_TOKENS tokens
  (± a spread, clipped), outputs of OUTPUT_TOKENS tokens (``ignore_eos``: exactly as many as
  asked), sent to ``/v1/completions`` with streaming, Poisson arrivals at each rate of
  ``--rates`` in turn (REQUESTS requests a rate); the highest rate is far above what two CPU
  cores serve, so the sweep ends in saturation (the measured throughput is the server's capacity).
- Reported per policy and rate, over the requests that succeeded: time to first token (TTFT),
  inter-token latency (ITL: (e2e - TTFT) / (output tokens - 1), vLLM's "TPOT"), guidellm's time
  per output token (TPOT: e2e / output tokens), end-to-end latency, each p50/p90/p99 (nearest
  rank on few samples: p99 of 16 requests is their maximum); request and output-token throughput
  over the benchmark's duration; and goodput: requests per second that met both latency targets,
  TTFT <= TTFT_TARGET_S and ITL <= ITL_TARGET_S (the SLO attainment is their share). The median
  lag of a request's send behind its Poisson arrival time is reported too: a rate whose schedule
  guidellm did not keep (on a loaded machine it once sent a whole rate at once) is run again.

    .venv/bin/python benchmarks/serving.py            # 16 minutes on 2 shared cores (make serving-bench)
    .venv/bin/python benchmarks/serving.py --quick    # rates 0.5 and 2, 4 requests each, vllm and orca (~3 min)
    .venv/bin/python benchmarks/serving.py --policies vllm v1 --rates 0.5 2

It writes ``serving.csv`` (one row per policy x rate), ``serving.md`` (the table) and
``serving_machine.json`` (CPU, cores, load, torch and guidellm versions, model, dtype, date) to
``--out`` (default ``benchmarks/results``); ``make figures`` draws ``13_serving_latency`` from the
CSV (``tinyserve.viz.serving``). guidellm's raw JSON goes to ``--raw`` (default: a temp dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"

# The latency targets of goodput: a request is "good" when it meets both.
TTFT_TARGET_S = 2.0
ITL_TARGET_S = 0.3
# The workload (guidellm's synthetic_text; prompt lengths drawn around PROMPT_TOKENS, clipped).
PROMPT_TOKENS, PROMPT_STDEV, PROMPT_MIN, PROMPT_MAX = 64, 16, 32, 96
OUTPUT_TOKENS, OUTPUT_STDEV, OUTPUT_MIN, OUTPUT_MAX = 16, 4, 8, 24
RATES = (0.25, 0.5, 1.0, 4.0)  # requests per second, Poisson; the last is past saturation
REQUESTS = 16  # per rate
SEED = 0
# Each policy: the server flags on top of the common ones.
POLICY_FLAGS = {
    "vllm": ["--policy", "vllm"],
    "orca": ["--policy", "orca"],
    "v1": ["--policy", "v1"],
    "vllm-chunked": ["--policy", "vllm", "--enable-chunked-prefill"],
}
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "itl", "tpot", "e2e")  # per request, in seconds
READY_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900
MAX_LAG_S = 1.0  # a request sent later than its Poisson arrival time by more (median over a rate) is a client fault


# -- reading guidellm's JSON ---------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values): on 16 samples p99 is the largest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def request_metrics(record: dict) -> dict:
    """One successful request of guidellm's JSON: its latencies in seconds and token counts."""
    ttft = record["time_to_first_token_ms"] / 1000
    e2e = record["request_latency"]
    out = record["output_tokens"] or 0
    itl = (e2e - ttft) / (out - 1) if out > 1 else math.nan
    tpot = e2e / out if out else math.nan
    timings = (record.get("info") or {}).get("timings") or {}
    lag = (timings["request_start"] - timings["targeted_start"]
           if timings.get("request_start") and timings.get("targeted_start") else math.nan)
    return dict(ttft=ttft, itl=itl, tpot=tpot, e2e=e2e, prompt_tokens=record["prompt_tokens"], output_tokens=out,
                lag=lag)


def summarize(report: dict, policy: str, ttft_target_s: float = TTFT_TARGET_S,
              itl_target_s: float = ITL_TARGET_S) -> list[dict]:
    """guidellm's JSON report as rows: one per benchmark (request rate) of ``policy``."""
    rows = []
    for bench in report["benchmarks"]:
        strategy = bench["config"]["strategy"]
        requests = bench["requests"]
        done = [request_metrics(r) for r in requests["successful"]]
        duration = bench["duration"]
        good = [r for r in done if r["ttft"] <= ttft_target_s and r["itl"] <= itl_target_s]
        row = dict(policy=policy, profile=strategy["type_"], rate=float(strategy.get("rate") or math.nan),
                   requests=sum(len(requests[k]) for k in ("successful", "errored", "incomplete")),
                   ok=len(done), errored=len(requests["errored"]), duration_s=round(duration, 2))
        for m in METRICS:
            for q in PERCENTILES:
                row[f"{m}_p{q}_s"] = round(percentile([r[m] for r in done], q), 4)
        per_s = 1 / duration if duration else math.nan
        row.update(req_per_s=round(len(done) * per_s, 4),
                   output_tok_per_s=round(sum(r["output_tokens"] for r in done) * per_s, 2),
                   goodput_req_per_s=round(len(good) * per_s, 4),
                   slo_attainment=round(len(good) / len(done), 3) if done else 0.0,
                   mean_prompt_tokens=round(sum(r["prompt_tokens"] for r in done) / len(done), 1) if done else 0,
                   mean_output_tokens=round(sum(r["output_tokens"] for r in done) / len(done), 1) if done else 0,
                   arrival_lag_p50_s=round(percentile([r["lag"] for r in done if not math.isnan(r["lag"])], 50), 3))
        rows.append(row)
    return rows


def markdown(rows: list[dict], ttft_target_s: float = TTFT_TARGET_S, itl_target_s: float = ITL_TARGET_S) -> str:
    """The table of the results, as ``benchmarks/results/serving.md`` and chapter 13 show it."""
    head = ["policy", "rate (req/s)", "ok", "TTFT p50 / p90 / p99 (s)", "ITL p50 / p90 (s)", "TPOT p50 (s)",
            "E2E p50 / p90 / p99 (s)", "req/s", "out tok/s",
            f"goodput (req/s, TTFT≤{ttft_target_s:g}s & ITL≤{itl_target_s:g}s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    def ps(r, m, qs=PERCENTILES):
        return " / ".join(f"{r[f'{m}_p{q}_s']:.2f}" for q in qs)

    for r in rows:
        lines.append(f"| {r['policy']} | {r['rate']:g} | {r['ok']}/{r['requests']} | {ps(r, 'ttft')} | "
                     f"{ps(r, 'itl', (50, 90))} | {r['tpot_p50_s']:.3f} | {ps(r, 'e2e')} | {r['req_per_s']:.2f} | "
                     f"{r['output_tok_per_s']:.1f} | {r['goodput_req_per_s']:.2f} ({r['slo_attainment']:.0%}) |")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# -- the machine ---------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def version_of(python: str, package: str) -> str:
    """The installed version of ``package`` in the environment of ``python``."""
    code = f"from importlib.metadata import version; print(version({package!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "unknown"


# -- the server ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(model: str) -> Path:
    """A local Hugging Face directory (with a tokenizer) for ``model``: guidellm loads its tokenizer
    from it offline, so the server is told to answer to this path as its model name."""
    if model == "smollm2-135m":
        from tinyserve.models.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model!r}: not 'smollm2-135m' nor a Hugging Face directory with a config.json")
    return path


class Server:
    """``python -m tinyserve.serve`` as a child process; ``stop()`` always ends it (Ctrl-C, then kill)."""

    def __init__(self, model: str, served_name: Path, flags: list[str], log_path: Path, device: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "tinyserve.serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", model, "--served-model-name", str(served_name), "--device", device,
               "--log-level", "warning", *flags]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered 200; SystemExit with the log if it dies or times out."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            if time.monotonic() - start > timeout_s:
                raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def warm_up(url: str, model: str) -> None:
    """One streamed request with the fields guidellm sends; refused, the run stops here and says why."""
    body = dict(model=model, prompt="Hello, my name is", max_tokens=8, stream=True, ignore_eos=True,
                stream_options=dict(include_usage=True, continuous_usage_stats=True))
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
    except urllib.error.HTTPError as e:
        answer = e.read().decode()[:500]
        why = "guidellm streams with stream_options {include_usage, continuous_usage_stats}, as vLLM takes them"
        raise SystemExit(f"the server refused a request shaped as guidellm's ({e.code}): {answer}\n({why})") from None


def run_guidellm(guidellm: Path, url: str, model: Path, rates: list[float], requests: int, seed: int,
                 out: Path, log_path: Path) -> dict:
    data = dict(kind="synthetic_text", prompt_tokens=PROMPT_TOKENS, prompt_tokens_stdev=PROMPT_STDEV,
                prompt_tokens_min=PROMPT_MIN, prompt_tokens_max=PROMPT_MAX, output_tokens=OUTPUT_TOKENS,
                output_tokens_stdev=OUTPUT_STDEV, output_tokens_min=OUTPUT_MIN, output_tokens_max=OUTPUT_MAX)
    backend = dict(kind="openai_http", target=url, model=str(model), request_format="/v1/completions", stream=True)
    cmd = [str(guidellm), "run", "--backend", json.dumps(backend),
           "--profile", json.dumps(dict(kind="poisson", rate=list(rates))),
           "--data", json.dumps(data), "--seed", json.dumps(dict(kind="static", value=seed)),
           "--constraint", json.dumps(dict(kind="max_requests", count=requests)),
           "--output", json.dumps(dict(kind="json", path=str(out))), "--disable-console-interactive"]
    # One worker process: its asyncio loop keeps every request in flight, and guidellm's default of
    # ten processes takes ~15 s to start each rate and competes for the two cores with the server.
    env = {"GUIDELLM__MAX_WORKER_PROCESSES": "1", **os.environ,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}); see {log_path}:\n{log_path.read_text()[-2000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    from tinyserve.config import POLICIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' or a local Hugging Face directory")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--policies", nargs="+", default=None, choices=list(POLICY_FLAGS),
                   help="default: every one this checkout has")
    p.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    p.add_argument("--requests", type=int, default=REQUESTS, help="requests per rate")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--quick", action="store_true", help="rates 0.5 and 2, 4 requests each, vllm and orca")
    p.add_argument("--guidellm", type=Path, default=GUIDELLM)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--raw", type=Path, default=None, help="where guidellm's JSON and the logs go (default: temp)")
    args = p.parse_args(argv)
    if not args.guidellm.exists():
        raise SystemExit(f"{args.guidellm} not found: `make serving-bench` builds .venv-guidellm")
    policies = args.policies or [k for k in POLICY_FLAGS if k.split("-")[0] in POLICIES]
    skipped = [k for k in policies if k.split("-")[0] not in POLICIES]
    if skipped:
        raise SystemExit(f"policies {skipped} are not in this checkout's POLICIES {POLICIES}")
    rates, requests = (([0.5, 2.0], 4) if args.quick else (args.rates, args.requests))
    if args.quick and args.policies is None:
        policies = ["vllm", "orca"]
    raw = args.raw or Path(tempfile.mkdtemp(prefix="tinyserve-serving-"))
    raw.mkdir(parents=True, exist_ok=True)
    served = model_dir(args.model)
    # SIGTERM (a make interrupted, a timeout) unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loads, rows, started = [load_average()], [], time.monotonic()
    print(f"serving benchmark: policies {policies}, rates {rates} req/s, {requests} requests a rate; raw: {raw}")
    for policy in policies:
        server = Server(args.model, served, POLICY_FLAGS[policy], raw / f"server_{policy}.log", args.device)
        try:
            ready = server.wait_ready()
            warm_up(server.url, str(served))
            t0 = time.monotonic()
            report = run_guidellm(args.guidellm, server.url, served, rates, requests, args.seed,
                                  raw / f"guidellm_{policy}.json", raw / f"guidellm_{policy}.log")
            # Under load guidellm has once started a rate's schedule without its start time, sending
            # every request at once: such a rate (arrivals late by more than MAX_LAG_S) is run again.
            late = [r["rate"] for r in summarize(report, policy) if r["arrival_lag_p50_s"] > MAX_LAG_S]
            if late:
                print(f"{policy}: the Poisson schedule was not kept at rates {late}; running them again")
                again = run_guidellm(args.guidellm, server.url, served, late, requests, args.seed,
                                     raw / f"guidellm_{policy}_again.json", raw / f"guidellm_{policy}_again.log")
                kept = [b for b in report["benchmarks"] if b["config"]["strategy"].get("rate") not in late]
                report = dict(report, benchmarks=sorted(kept + again["benchmarks"],
                                                         key=lambda b: b["config"]["strategy"].get("rate") or 0))
        finally:
            server.stop()
        loads.append(load_average())
        got = summarize(report, policy)
        rows += got
        print(f"{policy}: ready in {ready:.0f} s, guidellm {time.monotonic() - t0:.0f} s; load {loads[-1]}")
        for r in got:
            print(f"  rate {r['rate']:g}: {r['ok']}/{r['requests']} ok, TTFT p50 {r['ttft_p50_s']:.2f} s, "
                  f"ITL p50 {r['itl_p50_s']:.3f} s, {r['output_tok_per_s']:.1f} out tok/s, "
                  f"goodput {r['goodput_req_per_s']:.2f} req/s")
        args.out.mkdir(parents=True, exist_ok=True)  # rewritten after each policy: a cut run keeps what it measured
        write_csv(rows, args.out / "serving.csv")
    elapsed = time.monotonic() - started
    note = (f"Measured through `python -m tinyserve.serve` ({args.device}, float32) with guidellm "
            f"{version_of(str(args.guidellm.parent / 'python'), 'guidellm')}, model {args.model}: "
            f"{requests} requests a rate, Poisson arrivals (seed {args.seed}), streamed, prompts "
            f"{PROMPT_TOKENS}±{PROMPT_STDEV} tokens ({PROMPT_MIN}..{PROMPT_MAX}), outputs "
            f"{OUTPUT_TOKENS}±{OUTPUT_STDEV} ({OUTPUT_MIN}..{OUTPUT_MAX}, ignore_eos). ITL is (e2e - TTFT) / "
            f"(tokens - 1), vLLM's TPOT; TPOT is guidellm's, e2e / tokens. Goodput counts the requests with "
            f"TTFT ≤ {TTFT_TARGET_S:g} s and ITL ≤ {ITL_TARGET_S:g} s. Percentiles are nearest-rank over "
            f"the {requests} requests of a rate. Load averages during the run: {loads}.\n\n")
    (args.out / "serving.md").write_text(note + markdown(rows))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts = dict(cpu=cpu_model(), cores=cores, torch=version_of(sys.executable, "torch"),
                 guidellm=version_of(str(args.guidellm.parent / "python"), "guidellm"),
                 python=platform.python_version(),
                 model=args.model, device=args.device, dtype="float32",
                 date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 load_average_1_5_15=loads, load_note="os.getloadavg() before the run and after each policy; "
                 "the machine was shared while it ran", policies=policies, rates=rates, requests_per_rate=requests,
                 seed=args.seed, ttft_target_s=TTFT_TARGET_S, itl_target_s=ITL_TARGET_S,
                 workload=dict(prompt_tokens=[PROMPT_TOKENS, PROMPT_STDEV, PROMPT_MIN, PROMPT_MAX],
                               output_tokens=[OUTPUT_TOKENS, OUTPUT_STDEV, OUTPUT_MIN, OUTPUT_MAX],
                               endpoint="/v1/completions", stream=True),
                 seconds=round(elapsed, 1))
    (args.out / "serving_machine.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(markdown(rows))
    print(f"wrote {args.out / 'serving.csv'}, serving.md, serving_machine.json in {elapsed / 60:.1f} min")
    if args.raw is None:
        shutil.rmtree(raw, ignore_errors=True)


if __name__ == "__main__":
    main()
