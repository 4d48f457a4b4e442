"""Which grammar library structured output should use: llguidance, xgrammar or outlines-core.

Structured output (``response_format``, ``guided_json``, ``guided_regex``, ``guided_choice``) needs
a library that turns a grammar into the set of tokens allowed next, once per decode step and per
constrained request. This measures, for each library on SmolLM2-135M's tokenizer:

- how it installs on this CPU: whether the installed wheel is a binary wheel for this platform (no
  build from source), the wheel's size where the file it was installed from is still at hand, its
  installed size, its ``Requires-Dist`` (extras left out) and the installed size of everything those
  pull in, transitively, and what of that tinyserve's own requirements do not already install
  (xgrammar needs torch, transformers, triton and apache-tvm-ffi; tinyserve has all but the last);
- importing it, and preparing the tokenizer (its vocabulary as the library wants it), once per model;
- the one-time warm-up: the first mask computed in the process and the first call of the library's
  function that applies a mask to logits (llguidance's and outlines-core's go through
  ``torch.compile``, so the first call compiles a kernel, and again for a new batch shape);
- for five grammars (a small JSON schema, a nested one with objects in arrays, enums and bounded
  integers, ``{"type": "object"}`` as ``json_object`` mode asks for, an ISO-date regex and a choice
  among five strings): the compile time (grammar to a first ready matcher) and the per-step cost of
  computing the allowed-token mask (``fill``) and applying it to a float32 logits row the size of the
  vocabulary (``apply``), median and p95 over every token of a valid document, which is driven token
  by token through the tokenizer's own encoding of it; every token must be allowed, the end of
  sequence must be allowed once the document is complete, and a token that breaks the grammar ("Z",
  at the start and after the end) must be masked;
- the same for a batch of 16 rows, 16 matchers at different positions of the document (what one
  decode step of 16 constrained requests pays), with each library's batch call where it has one.

Each library uses its fastest documented CPU path: llguidance's ``llguidance.torch`` functions
(``fill_next_token_bitmask``, ``fill_next_token_bitmask_par`` with an ``LLExecutor`` for a batch),
xgrammar's ``fill_next_token_bitmask`` / ``BatchGrammarMatcher`` and its C++ CPU
``apply_token_bitmask_inplace``, outlines-core's ``Guide.write_mask_into`` and
``outlines_core.kernels.torch``. llguidance is measured twice: with its default "slices" (a
precomputed split of the vocabulary that speeds up the mask) and with ``slices=[]``. All three write
the same bit-packed int32 mask, so a plain-torch apply (no ``torch.compile``, no warm-up) is measured
once for all of them and checked against each library's own.

Each library runs in a fresh process, so no warm-up is paid by one and inherited by another, twice
(``--rounds``), alternating with the others, and each number is the lesser of the two: the machine
may be shared. torch runs one thread (``--threads``): on a loaded 2-core machine every parallel
region waits for its slowest thread. The choice at the end of the Markdown prices one constrained
answer of 256 tokens in a batch of 16 (its grammar's compile plus its share of each step's mask; the
apply is left out, since any apply works with any library's mask) and picks the cheapest among the
libraries that pass every check and add no heavy dependency to tinyserve's own.

    python benchmarks/grammar_libraries.py [--repeats N] [--rounds N] [--threads N] [--out DIR]

llguidance is a tinyserve requirement; xgrammar and outlines-core are extra installs, for this
benchmark only (``pip install xgrammar outlines-core``). A library that is not installed is
reported as "not installed" rather than failing. Results: ``results/grammar_libraries.csv`` (one
row per library and grammar) and ``results/grammar_libraries.md`` (the tables and the choice they
support).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the Makefile does, before torch starts

from common import RESULTS_DIR, machine, table  # noqa: E402

BATCH = 16
# (library, variant): the distribution to look up and the backend class below.
LIBRARIES = [("llguidance", "default slices"), ("llguidance", "no slices"), ("xgrammar", ""),
             ("outlines-core", "")]

SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"sku": {"type": "string"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["sku", "qty"], "additionalProperties": False}
NESTED_SCHEMA = {"type": "object", "properties": {
    "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
    "status": {"enum": ["pending", "shipped", "delivered"]},
    "items": {"type": "array", "items": ITEM, "minItems": 1}},
    "required": ["order_id", "status", "items"], "additionalProperties": False}
CHOICES = ["red", "green", "blue", "yellow", "purple"]
DATE_REGEX = r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"  # ASCII: \d is any Unicode digit
# name -> (kind, spec, a valid document)
GRAMMARS = {
    "json_small": ("json", SMALL_SCHEMA, json.dumps({"name": "Ada Lovelace", "age": 36,
                                                      "tags": ["math", "engines", "poetry"]})),
    "json_nested": ("json", NESTED_SCHEMA, json.dumps({"order_id": 4172, "status": "shipped", "items": [
        {"sku": "A-100", "qty": 2, "tags": ["blue", "large"]}, {"sku": "B-7", "qty": 100}]})),
    "json_object": ("json", {"type": "object"}, json.dumps({"city": "Paris", "population": 2102650,
                                                             "tags": ["capital", "europe"], "river": None})),
    "regex_date": ("regex", DATE_REGEX, "2024-03-15"),
    "choice_5": ("choice", CHOICES, "yellow"),
}
VIOLATION = "Z"  # no grammar above allows it first or after the end


# ---------------------------------------------------------------- tokens as bytes (outlines, tests)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE token spells a byte with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each token id stands for in a byte-level BPE tokenizer; None for special tokens."""
    u2b, special = _unicode_to_byte(), set(tokenizer.all_special_ids)
    out: list[bytes | None] = [None] * len(tokenizer)
    for text, tid in tokenizer.get_vocab().items():
        if tid not in special and tid < len(out):
            out[tid] = bytes(u2b[c] for c in text) if all(c in u2b for c in text) else text.encode()
    return out


def allowed_ids(bitmask_row, vocab_size: int) -> set[int]:
    """The token ids whose bit is set in one row of a bit-packed int32 mask (bit j of word i is
    token 32 * i + j, the layout all three libraries write)."""
    words = bitmask_row.tolist()
    return {t for t in range(vocab_size) if (words[t >> 5] >> (t & 31)) & 1}


_BYTE_TO_BIAS = None


def apply_bitmask_torch(logits, bitmask) -> None:
    """Set the logits of masked tokens to -inf, in plain torch: no ``torch.compile``, so no warm-up.

    Each byte of the mask is looked up in a 256 x 8 table of 0 / -inf and the row of eight biases is
    added to the logits (x + 0 is x, x - inf is -inf): one gather and one add, no 32-way unpacking."""
    import torch

    global _BYTE_TO_BIAS
    if _BYTE_TO_BIAS is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _BYTE_TO_BIAS = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
    # Little-endian: byte k of word i holds tokens 32 * i + 8 * k ... + 7, lowest bit first.
    by = bitmask.contiguous().view(torch.uint8).reshape(-1).int()
    bias = _BYTE_TO_BIAS.index_select(0, by).view(bitmask.shape[0], -1)
    logits += bias[:, : logits.shape[1]]


# ---------------------------------------------------------------- the three libraries, one interface
class LLGuidance:
    dist = "llguidance"

    def __init__(self, tokenizer, variant: str = "default slices"):
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        self.vocab = len(tokenizer)
        # slices=None is llguidance's default split of the vocabulary; [] turns it off.
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab,
                                                slices=[] if variant == "no slices" else None)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec):
        M = self.ll.LLMatcher
        if kind == "json":
            return M.grammar_from_json_schema(json.dumps(spec))
        if kind == "regex":
            return M.grammar_from_regex(spec)
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def alloc(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def reset(self, m) -> None:
        m.reset()


class XGrammar:
    dist = "xgrammar"

    def __init__(self, tokenizer, variant: str = ""):
        import xgrammar as xg

        self.xg, self.vocab = xg, len(tokenizer)
        self.compiler = xg.GrammarCompiler(xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab))
        self.batcher = xg.BatchGrammarMatcher()

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def alloc(self, batch: int):
        return self.xg.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask) -> None:
        self.xg.apply_token_bitmask_inplace(logits, bitmask)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def reset(self, m) -> None:
        m.reset()


class OutlinesCore:
    dist = "outlines-core"

    def __init__(self, tokenizer, variant: str = ""):
        import outlines_core as oc
        import outlines_core.kernels.torch as ok

        self.oc, self.ok, self.vocab = oc, ok, len(tokenizer)
        # outlines-core wants the vocabulary as bytes -> token ids, without the end-of-sequence token.
        vmap: dict[bytes, list[int]] = {}
        for tid, b in enumerate(token_bytes(tokenizer)):
            if b and tid != tokenizer.eos_token_id:
                vmap.setdefault(b, []).append(tid)
        self.vocabulary = oc.Vocabulary(tokenizer.eos_token_id, vmap)

    def compile(self, kind: str, spec):
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        elif kind == "regex":
            regex = spec
        else:
            regex = "(" + "|".join(re.escape(c) for c in spec) + ")"
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def alloc(self, batch: int):
        import torch

        return torch.full((batch, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers, bitmask) -> None:
        # No batch call: one write per row, straight into the row's memory.
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def apply(self, logits, bitmask) -> None:
        self.ok.apply_token_bitmask_inplace(logits, bitmask)

    def consume(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def reset(self, m) -> None:
        m.reset()


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}
# What each backend imports: timed on its own, since llguidance.torch and outlines_core.kernels.torch
# decorate their apply with torch.compile, which imports torch's compiler stack.
MODULES = {"llguidance": ["llguidance", "llguidance.hf", "llguidance.torch"], "xgrammar": ["xgrammar"],
           "outlines-core": ["outlines_core", "outlines_core.kernels.torch"]}


# ---------------------------------------------------------------- measuring
def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def _masked(logits_row, token: int) -> bool:
    return bool(logits_row[token] == float("-inf"))


def _drive_one(lib, compiled, ids: list[int], eos: int, bad: int, logits) -> dict:
    """One matcher through ``ids`` then the end: per-step fill/apply times and what was allowed."""
    m = lib.matcher(compiled)
    bm = lib.alloc(1)
    fill, apply, consume = [], [], []
    out = dict(allowed=0, eos_allowed=False, violation_masked=True, torch_apply_matches=True)
    for step in range(len(ids) + 1):
        x = logits.clone()
        t0 = time.perf_counter()
        lib.fill([m], bm)
        t1 = time.perf_counter()
        lib.apply(x, bm)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        if step == 0:
            ref = logits.clone()
            apply_bitmask_torch(ref, bm)
            out["torch_apply_matches"] = bool(torch_equal(ref, x))
        if step in (0, len(ids)):
            out["violation_masked"] &= _masked(x[0], bad)
        if step == len(ids):
            out["eos_allowed"] = not _masked(x[0], eos)
            break
        if _masked(x[0], ids[step]):
            break
        t0 = time.perf_counter()
        ok = lib.consume(m, ids[step])
        consume.append(time.perf_counter() - t0)
        if not ok:
            break
        out["allowed"] += 1
    return dict(out, fill=fill, apply=apply, consume=consume)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _drive_batch(lib, compiled, ids: list[int], eos: int, logits16, steps: int) -> dict:
    """BATCH matchers, matcher j starting j steps into the document (restarting after the end), so the
    rows of one step are at different positions, as concurrent requests are."""
    n = len(ids) + 1  # steps of one document: its tokens, then the end
    matchers = [lib.matcher(compiled) for _ in range(BATCH)]
    pos = [j % n for j in range(BATCH)]
    for m, p in zip(matchers, pos):
        for t in ids[:p]:
            lib.consume(m, t)
    bm = lib.alloc(BATCH)
    fill, apply, loop, all_allowed = [], [], [], True
    for _ in range(steps):
        x = logits16.clone()
        # The same rows one call at a time, for libraries whose batch call costs more than a loop.
        t0 = time.perf_counter()
        for j, m in enumerate(matchers):
            lib.fill([m], bm[j:j + 1])
        loop.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lib.fill(matchers, bm)
        t1 = time.perf_counter()
        lib.apply(x, bm)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        for j, m in enumerate(matchers):
            if pos[j] == len(ids):
                all_allowed &= not _masked(x[j], eos)
                lib.reset(m)
                pos[j] = 0
            else:
                tok = ids[pos[j]]
                all_allowed &= not _masked(x[j], tok) and lib.consume(m, tok)
                pos[j] += 1
    return dict(fill=fill, apply=apply, loop=loop, all_allowed=all_allowed)


def measure_library(name: str, tokenizer, variant: str = "", repeats: int = 5, grammars=None) -> dict:
    """Everything one library costs on ``tokenizer``: preparation, warm-up, and per grammar the compile
    time and the per-step mask cost at batch 1 and BATCH. Meant to run in a fresh process, so the
    warm-up is this library's own."""
    import torch

    grammars = grammars or GRAMMARS
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    bad = tokenizer.encode(VIOLATION, add_special_tokens=False)
    assert len(bad) == 1, bad
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=gen)
    logits16 = torch.randn(BATCH, vocab, generator=gen)

    import importlib

    t0 = time.perf_counter()
    for module in MODULES[name]:
        importlib.import_module(module)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lib = BACKENDS[name](tokenizer, variant)
    lib_info = dict(library=name, variant=variant, import_s=import_s, prepare_s=time.perf_counter() - t0)
    # A first grammar pays one-time set-up (xgrammar's and outlines-core's first JSON schema more so):
    # timed here as warm-up, so every grammar below is compiled in the steady state.
    t0 = time.perf_counter()
    lib.matcher(lib.compile("json", {"type": "string"}))
    lib_info["first_compile_ms"] = 1e3 * (time.perf_counter() - t0)
    rows = []
    first = True
    for gname, (kind, spec, doc) in grammars.items():
        ids = tokenizer.encode(doc, add_special_tokens=False)
        row = dict(grammar=gname, tokens=len(ids), error="")
        try:
            t0 = time.perf_counter()
            compiled = lib.compile(kind, spec)
            lib.matcher(compiled)
            row["compile_ms"] = 1e3 * (time.perf_counter() - t0)
        except Exception as e:  # a library that cannot express the grammar: recorded, not fatal
            rows.append(dict(row, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        runs = [_drive_one(lib, compiled, ids, eos, bad[0], logits) for _ in range(repeats)]
        if first:  # the first mask and the first apply of this process: the library's warm-up
            lib_info.update(first_fill_ms=1e3 * runs[0]["fill"][0], first_apply_ms=1e3 * runs[0]["apply"][0])
        # The first run's first step is the warm-up; steady state is every step after it.
        fill = [t for r in runs for t in r["fill"]][1:]
        apply = [t for r in runs for t in r["apply"]][1:]
        step = [f + a for f, a in zip(fill, apply)]
        batch = _drive_batch(lib, compiled, ids, eos, logits16, steps=repeats * (len(ids) + 1) + 1)
        if first:
            lib_info["first_apply16_ms"] = 1e3 * batch["apply"][0]
            first = False
        bstep = [f + a for f, a in zip(batch["fill"][1:], batch["apply"][1:])]
        r0 = runs[0]
        row.update(
            allowed=min(r["allowed"] for r in runs), eos_allowed=all(r["eos_allowed"] for r in runs),
            violation_masked=all(r["violation_masked"] for r in runs),
            torch_apply_matches=r0["torch_apply_matches"], batch_all_allowed=batch["all_allowed"],
            fill_med_us=1e6 * statistics.median(fill), apply_med_us=1e6 * statistics.median(apply),
            step_med_us=1e6 * statistics.median(step), step_p95_us=1e6 * _pct(step, 0.95),
            consume_med_us=1e6 * statistics.median([t for r in runs for t in r["consume"]] or [0.0]),
            b16_fill_med_us=1e6 * statistics.median(batch["fill"][1:]),
            b16_fill_loop_med_us=1e6 * statistics.median(batch["loop"][1:]),
            b16_apply_med_us=1e6 * statistics.median(batch["apply"][1:]),
            b16_step_med_us=1e6 * statistics.median(bstep), b16_step_p95_us=1e6 * _pct(bstep, 0.95))
        rows.append(row)
    return dict(lib_info, rows=rows)


def torch_apply_cost(vocab: int, rounds: int = 200) -> dict:
    """Median cost of ``apply_bitmask_torch`` on 1 and BATCH rows of ``vocab`` logits (half allowed)."""
    import torch

    out = {}
    for batch in (1, BATCH):
        logits = torch.randn(batch, vocab)
        bm = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
        times = []
        for _ in range(rounds):
            x = logits.clone()
            t0 = time.perf_counter()
            apply_bitmask_torch(x, bm)
            times.append(time.perf_counter() - t0)
        out[f"torch_apply{batch}_med_us"] = 1e6 * statistics.median(times)
    return out


# ---------------------------------------------------------------- installation facts
def _installed_mb(dist) -> float:
    return sum((f.size or 0) for f in dist.files or []) / 1e6


def _requirements(dist) -> list[str]:
    """``Requires-Dist`` without extras, markers evaluated for this machine."""
    from packaging.requirements import Requirement

    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(str(req))
    return out


def install_info(dist_name: str) -> dict:
    """How ``dist_name`` is installed: version, binary wheel for this platform or not, sizes, and what
    it pulls in (its requirements, transitively, with their installed sizes)."""
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return dict(installed=False)
    wheel = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    here = {str(t) for t in sys_tags()}
    wheel_mb = None
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.startswith("file://") and Path(url[7:]).is_file():
        wheel_mb = Path(url[7:]).stat().st_size / 1e6
    closure = _closure([Requirement(r).name for r in _requirements(dist)])
    beyond = {k: v for k, v in closure.items() if k not in _closure(_tinyserve_requirements())}
    listed = lambda d: ", ".join(f"{k} {d[k]:.0f} MB" for k in sorted(d, key=lambda k: -d[k]))  # noqa: E731
    return dict(installed=True, version=dist.version, wheel_tag=tags[0] if tags else "",
                binary_wheel_here=any(t in here for t in tags) and "Root-Is-Purelib: false" in wheel,
                wheel_mb=wheel_mb, installed_mb=_installed_mb(dist), requires=", ".join(_requirements(dist)),
                deps_mb=sum(closure.values()), heavy_deps=listed({k: v for k, v in closure.items() if v >= HEAVY_MB}),
                beyond_tinyserve_mb=sum(beyond.values()), beyond_tinyserve=listed(beyond))


HEAVY_MB = 20  # a dependency that installs this much or more is named as heavy


def _closure(names: list[str]) -> dict[str, float]:
    """The installed distributions ``names`` need, transitively, each with its installed size in MB."""
    from packaging.requirements import Requirement

    closure: dict[str, float] = {}
    todo = list(names)
    while todo:
        try:
            d = metadata.distribution(todo.pop())
        except metadata.PackageNotFoundError:
            continue
        key = d.metadata["Name"].lower().replace("_", "-")
        if key not in closure:
            closure[key] = _installed_mb(d)
            todo += [Requirement(r).name for r in _requirements(d)]
    return closure


def _tinyserve_requirements() -> list[str]:
    """The names in tinyserve's requirements.txt, markers evaluated, the grammar libraries left out:
    what a library's dependencies cost on top of is what tinyserve installs anyway."""
    from packaging.requirements import Requirement

    names = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            if (req.marker is None or req.marker.evaluate()) and req.name not in BACKENDS:
                names.append(req.name)
    return names


# ---------------------------------------------------------------- results
COLUMNS = ["library", "variant", "version", "binary_wheel_here", "wheel_mb", "installed_mb", "deps_mb",
           "heavy_deps", "beyond_tinyserve_mb", "beyond_tinyserve", "requires", "import_s", "prepare_s",
           "first_compile_ms", "first_fill_ms", "first_apply_ms", "first_apply16_ms", "grammar", "tokens", "error",
           "compile_ms",
           "allowed", "eos_allowed", "violation_masked", "torch_apply_matches", "batch_all_allowed",
           "fill_med_us", "apply_med_us", "step_med_us", "step_p95_us", "consume_med_us", "b16_fill_med_us",
           "b16_fill_loop_med_us", "b16_apply_med_us", "b16_step_med_us", "b16_step_p95_us"]
REQUEST_TOKENS = 256  # the constrained answer the choice prices: compile + this many steps in a batch of 16


def least(a, b):
    """Two measurements of the same thing merged: the lesser of each time (the run least disturbed by
    other work on the machine), every check that must hold in both, the first error."""
    if isinstance(a, dict):
        return {k: least(a[k], b.get(k, a[k])) for k in a}
    if isinstance(a, list):
        return [least(x, y) for x, y in zip(a, b)] if len(a) == len(b) else a
    if isinstance(a, bool):
        return a and b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return min(a, b)
    return a or b


def flatten(results: list[dict]) -> list[dict]:
    """One CSV row per library variant and grammar (one row saying why, for a library not installed)."""
    rows = []
    for res in results:
        head = {k: v for k, v in res.items() if k != "rows"}
        for r in res.get("rows") or [dict(grammar="", error=res.get("error", ""))]:
            rows.append({c: _round(dict(head, **r).get(c, "")) for c in COLUMNS})
    return rows


def _round(v):
    return round(v, 4) if isinstance(v, float) else ("" if v is None else v)


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _name(r: dict) -> str:
    return r["library"] + (f" ({r['variant']})" if r["variant"] else "")


def _f(v, spec: str) -> str:
    return "" if v in ("", None) else format(float(v), spec)


def _passed(r: dict) -> bool:
    """Every check of a grammar's row: compiled, every token allowed, the end allowed, the breaking
    token masked, at batch 1 and 16."""
    return (not r["error"] and int(r["allowed"]) == int(r["tokens"]) and _true(r["eos_allowed"])
            and _true(r["batch_all_allowed"]) and _true(r["violation_masked"]))


def _true(v) -> bool:
    return v is True or v == "True"


def _mask16(r: dict) -> float:
    """The cheaper of the library's batch call and a loop of single calls, for 16 rows (µs)."""
    return min(float(r["b16_fill_med_us"]), float(r["b16_fill_loop_med_us"]))


def _request_ms(r: dict) -> float:
    """One constrained answer of REQUEST_TOKENS tokens in a batch of 16: its grammar's compile, then its
    sixteenth of each step's mask. The apply is left out: every library writes the same mask, so any
    apply works with any of them."""
    return float(r["compile_ms"]) + REQUEST_TOKENS * _mask16(r) / 16 / 1000


def markdown(rows: list[dict], torch_apply: dict, note: str) -> str:
    """The tables of the results and the choice they support, every number read from ``rows``."""
    libs: dict[str, dict] = {}
    for r in rows:
        libs.setdefault(_name(r), r)
    md = [note, "", "## Installing and preparing", "",
          "| library | version | binary wheel for this CPU | wheel MB | installed MB | Requires-Dist | pulls in (MB) "
          "| heavy (≥ 20 MB) | beyond tinyserve's requirements | import (s) | tokenizer prep (s) | first compile (ms) "
          "| first mask (ms) | first apply, 1 / 16 rows (ms) |", "|" + "---|" * 14]
    for name, r in libs.items():
        if not r["version"]:
            md.append(f"| {name} | not installed |" + " |" * 12)
            continue
        md.append(f"| {name} | {r['version']} | {'yes' if _true(r['binary_wheel_here']) else 'no'} "
                  f"| {_f(r['wheel_mb'], '.1f') or 'n/a'} | {_f(r['installed_mb'], '.1f')} | {r['requires'] or 'none'} "
                  f"| {_f(r['deps_mb'], '.0f')} | {r['heavy_deps'] or 'none'} | {r['beyond_tinyserve'] or 'nothing'} "
                  f"| {_f(r['import_s'], '.2f')} | {_f(r['prepare_s'], '.2f')} | {_f(r['first_compile_ms'], '.1f')} "
                  f"| {_f(r['first_fill_ms'], '.1f')} "
                  f"| {_f(r['first_apply_ms'], '.0f')} / {_f(r['first_apply16_ms'], '.0f')} |")
    md += ["", "## Per grammar (steady state, µs)", "",
           "mask = the library computing the allowed tokens; apply = its own function setting the others to -inf; "
           "batch 16 = one step of 16 constrained requests at different positions (mask: the cheaper of the "
           "library's batch call and a loop of single calls).", "",
           "| library | grammar | tokens | compile (ms) | mask | apply | mask + apply p50 | p95 | batch 16: mask "
           "| mask + apply p50 | p95 | checks |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["grammar"]:
            continue
        if r["error"]:
            md.append(f"| {_name(r)} | {r['grammar']} | {r['tokens']} | failed: {r['error']} |" + " |" * 8)
            continue
        md.append(f"| {_name(r)} | {r['grammar']} | {r['tokens']} | {_f(r['compile_ms'], '.1f')} "
                  f"| {_f(r['fill_med_us'], '.0f')} | {_f(r['apply_med_us'], '.0f')} | {_f(r['step_med_us'], '.0f')} "
                  f"| {_f(r['step_p95_us'], '.0f')} | {_mask16(r):.0f} | {_f(r['b16_step_med_us'], '.0f')} "
                  f"| {_f(r['b16_step_p95_us'], '.0f')} | {'pass' if _passed(r) else 'FAIL'} |")
    same = all(_true(r["torch_apply_matches"]) for r in rows if r["grammar"] and not r["error"])
    md += ["", "checks: every token of the valid document allowed and the end allowed after it (at batch 1 and "
           "16), and a token breaking the grammar masked.", "",
           f"The plain-torch apply of the same mask (`apply_bitmask_torch`: no `torch.compile`, so no warm-up; "
           f"the same logits as every library's own apply: {'yes' if same else 'NO'}) costs "
           f"{torch_apply['torch_apply1_med_us']:.0f} µs for one row and "
           f"{torch_apply[f'torch_apply{BATCH}_med_us']:.0f} µs for {BATCH} rows.", "", "## Choice", "", choice(rows)]
    return "\n".join(md) + "\n"


def _deps(name: str, r: dict) -> str:
    text = f"{name} {'needs ' + r['heavy_deps'] if r['heavy_deps'] else 'needs nothing heavy'}"
    return text + (f" (beyond tinyserve's requirements: {r['beyond_tinyserve']})" if r["beyond_tinyserve"] else "")


def choice(rows: list[dict]) -> str:
    """The paragraph naming the cheapest mask per step, the cheapest with each library's own apply, the
    fastest compile and the dependencies, then the pick: the cheapest constrained request among the
    libraries that pass every check and add no heavy dependency to tinyserve's own."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["grammar"]:
            by.setdefault(_name(r), []).append(r)
    passed = {n: rs for n, rs in by.items() if all(_passed(r) for r in rs)}
    if not passed:
        return "No library passed every grammar."
    mean = lambda f: {n: statistics.mean(f(r) for r in rs) for n, rs in passed.items()}  # noqa: E731
    mask1, mask16 = mean(lambda r: float(r["fill_med_us"])), mean(_mask16)
    step1, step16 = mean(lambda r: float(r["step_med_us"])), mean(lambda r: float(r["b16_step_med_us"]))
    request = mean(_request_ms)
    comp = {n: statistics.median(float(r["compile_ms"]) for r in rs) for n, rs in passed.items()}
    worst = {n: max(float(r["compile_ms"]) for r in rs) for n, rs in passed.items()}

    def ranked(d: dict, spec: str, unit: str) -> str:
        order = sorted(d, key=d.get)
        return f"{order[0]}, {d[order[0]]:{spec}} {unit}" + (
            " (then " + ", ".join(f"{n} {d[n]:{spec}}" for n in order[1:]) + ")" if order[1:] else "")

    text = [f"Means over the {len(next(iter(passed.values())))} grammars, steady state. "
            f"Cheapest mask for one row: {ranked(mask1, '.0f', 'µs')}; for a batch of {BATCH}: "
            f"{ranked(mask16, '.0f', 'µs')}.",
            f"With each library's own apply, one row: {ranked(step1, '.0f', 'µs')}; {BATCH} rows: "
            f"{ranked(step16, '.0f', 'µs')}.",
            f"Fastest to compile (median over the grammars): {ranked(comp, '.1f', 'ms')}; slowest compile of each: "
            + ", ".join(f"{n} {worst[n]:.1f} ms" for n in sorted(worst, key=worst.get)) + ".",
            "Dependencies: " + "; ".join(_deps(n, rs[0]) for n, rs in passed.items()) + "."]
    failed = sorted(set(by) - set(passed))
    if failed:
        text.append("Failed a grammar or a check: " + ", ".join(failed) + ".")
    light = {n: v for n, v in request.items() if not passed[n][0]["heavy_deps"]}
    pick = min(light or request, key=(light or request).get)
    r0 = passed[pick][0]
    text.append(f"A constrained answer of {REQUEST_TOKENS} tokens in a batch of {BATCH} (its compile plus its "
                f"share of each step's mask) costs {ranked(request, '.1f', 'ms')}.")
    text.append(f"So tinyserve uses {pick}: the cheapest such answer among the libraries that pass every check "
                f"and need no heavy dependency ({'none at all' if not r0['requires'] else r0['requires']}; "
                f"{'a binary wheel for this CPU' if _true(r0['binary_wheel_here']) else 'built from source'}).")
    best = min(mask16, key=mask16.get)
    if best.split(" (")[0] != pick.split(" (")[0]:
        heavy = passed[best][0]["heavy_deps"]
        text.append(f"{best} computes the mask for {BATCH} rows in {mask16[best]:.0f} µs against {mask16[pick]:.0f}, "
                    + (f"but needs {heavy}." if heavy else f"but its answer costs {request[best]:.1f} ms."))
    return " ".join(text)


# ---------------------------------------------------------------- running
def _load_tokenizer():
    from transformers import AutoTokenizer

    from tinyserve.models.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def run_in_subprocess(name: str, variant: str, repeats: int, threads: int) -> dict:
    """``measure_library`` in a fresh Python, so each library pays its own warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, __file__, "--worker", name, "--variant", variant, "--repeats", str(repeats),
               "--threads", str(threads), "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return dict(library=name, variant=variant, error=f"worker failed: {proc.stderr.strip()[-300:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="times each document is driven at batch 1")
    ap.add_argument("--rounds", type=int, default=2,
                    help="fresh processes per library, alternating; each number is the least of the rounds")
    # One torch thread: the mask is a small side job, and on a shared machine a parallel region waits for
    # every thread (with 2 threads on a loaded 2-core machine, cloning 16 rows of logits took 15 ms, not 0.3).
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the libraries' batch calls keep theirs)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one library in this process
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        res = measure_library(args.worker, _load_tokenizer(), args.variant, args.repeats)
        args.json.write_text(json.dumps(res))
        return

    print(f"machine: {machine()}")
    load_before = os.getloadavg()
    tokenizer = _load_tokenizer()
    measured: dict[tuple[str, str], dict] = {}
    infos = {name: install_info(name) for name, _ in LIBRARIES}
    for rnd in range(args.rounds):
        for name, variant in LIBRARIES:
            if not infos[name]["installed"]:
                continue
            t0 = time.perf_counter()
            res = run_in_subprocess(name, variant, args.repeats, args.threads)
            print(f"round {rnd + 1}: {name} {variant} measured in {time.perf_counter() - t0:.0f} s "
                  f"{res.get('error', '')}")
            prev = measured.get((name, variant))
            if prev is None or "error" in prev:
                measured[(name, variant)] = res
            elif "error" not in res:
                measured[(name, variant)] = least(prev, res)
    results = []
    for name, variant in LIBRARIES:
        if not infos[name]["installed"]:
            print(f"{name}: not installed (pip install {name})")
            results.append(dict(library=name, variant=variant, error="not installed"))
        else:
            results.append(dict(infos[name], **measured[(name, variant)]))
    rows = flatten(results)
    torch_apply = torch_apply_cost(len(tokenizer))
    load_after = os.getloadavg()
    print(table([r for r in rows if r["grammar"]],
                ["library", "variant", "grammar", "tokens", "compile_ms", "fill_med_us", "apply_med_us",
                 "step_med_us", "step_p95_us", "b16_fill_med_us", "b16_fill_loop_med_us", "b16_step_med_us"],
                {k: ".1f" for k in COLUMNS if k.endswith(("_ms", "_us"))}))
    print(f"plain-torch apply: {torch_apply}")
    note = (f"# Grammar libraries for structured output\n\nMeasured by `benchmarks/grammar_libraries.py` on "
            f"SmolLM2-135M's tokenizer (vocabulary {len(tokenizer)}): each library in {args.rounds} fresh "
            f"processes, alternating with the others, each number the least of them; {args.repeats} passes over "
            f"each document at batch 1; {args.threads} torch thread(s). Machine: {machine()}. Load averages "
            f"before and after: {[round(x, 2) for x in load_before]}, {[round(x, 2) for x in load_after]}: the "
            f"p95 and batch-16 columns (threads, more memory) are the ones other work on the machine moves most.")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "grammar_libraries.csv")
    md = markdown(rows, torch_apply, note)
    (args.out / "grammar_libraries.md").write_text(md)
    print(md.split("## Choice", 1)[1])
    print(f"wrote {args.out / 'grammar_libraries.csv'} and grammar_libraries.md")


if __name__ == "__main__":
    main()
