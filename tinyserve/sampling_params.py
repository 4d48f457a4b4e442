"""SamplingParams: how a request picks its next tokens and when it stops (vLLM's names).

Every field is range-checked on construction, so a bad value is a ValueError that names the
field, raised where the request is made, and never a failure inside a running step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinyserve.guided_params import GuidedDecodingParams

# Bounds that keep every value representable where it goes: token counts and top_k fit int32
# tensors, seeds fit torch's int64 generator seed (children of ``n > 1`` use seed + i), and a
# temperature below MIN_TEMPERATURE would overflow ``logits / temperature`` to inf.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_N = 1024
MIN_TEMPERATURE = 1e-5
# Top log-probabilities a request may ask for per token (OpenAI's chat API allows up to 20).
MAX_LOGPROBS = 20
# What each RequestOutput of a request carries (vLLM's RequestOutputKind, from its later versions):
# everything so far, only what is new since the request's last output, or one output at the end.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_int(name: str, value, low: int, high: int, extra: str = "") -> None:
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{extra}, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. ``temperature=0`` means greedy.

    Every field is checked on construction (``verify``), so a bad value is a ValueError that
    names the field, raised where the request is made, never a failure inside a running step.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS
    # vLLM v0.4's further fields (chapter 9, "sampling features"):
    best_of: int | None = None  # samples drawn; the n with the highest cumulative logprob are returned
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    min_tokens: int = 0  # no EOS, stop token id or stop string before this many tokens
    logprobs: int | None = None  # per output token: the chosen token's logprob and the top-k
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    include_stop_str_in_output: bool = False
    # Constraints on the next token (vLLM's later fields; chapter 12, "structured output"):
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn
    bad_words: list[str] | None = None  # words the output may not contain (as the tokenizer spells them)
    guided_decoding: GuidedDecodingParams | None = None  # a JSON schema, regex, choice or grammar to follow
    # Beam search (chapter 14), v0.4's fields: best_of is the beam width.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a beam's score is its cumulative logprob / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never": when no running beam can win (beam_search.py)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field's type and range (the engine calls it again when a request arrives,
        in case a field was changed after construction)."""
        _check_int("n", self.n, 1, MAX_N)
        if not _is_finite_number(self.temperature) or (self.temperature != 0 and self.temperature < MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature!r}")
        if not _is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.top_k != -1:
            _check_int("top_k", self.top_k, 1, MAX_INT32, extra=" or -1 (disabled)")
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, {MAX_INT32}], "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        self._verify_v04_fields()
        self._verify_constraints()
        if self.use_beam_search is not False:
            self._verify_beam_search()
            return
        if self.early_stopping is not False:
            raise ValueError("early_stopping is not effective and must be False when not using beam search")
        if not _is_finite_number(self.length_penalty) or abs(self.length_penalty - 1.0) > 1e-5:
            raise ValueError("length_penalty is not effective and must be the default value of 1.0 when not using "
                             "beam search")
        if self.n > 1 and self.temperature == 0:
            raise ValueError("n > 1 needs temperature > 0: greedy samples would all be identical")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("best_of > 1 needs temperature > 0: greedy samples would all be identical")

    def _verify_beam_search(self) -> None:
        """v0.4's checks (``_verify_beam_search``), then what tinyserve does not combine with it."""
        if self.use_beam_search is not True:
            raise ValueError(f"use_beam_search must be True or False, got {self.use_beam_search!r}")
        if self.num_samples == 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.num_samples}")
        if self.temperature != 0:
            raise ValueError("temperature must be 0 when using beam search")
        if self.top_p != 1.0:
            raise ValueError("top_p must be 1 when using beam search")
        if self.top_k != -1:
            raise ValueError("top_k must be -1 when using beam search")
        if not isinstance(self.early_stopping, (bool, str)) or self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not _is_finite_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        # tinyserve ranks beams by the model's own log-probabilities: anything that changes the
        # logits (v0.4 ranks by the changed ones) is refused rather than ranked inconsistently.
        if self.has_penalties or self.min_p != 0 or self.min_tokens != 0 or self.has_constraints:
            raise ValueError("tinyserve does not combine beam search with penalties, min_p, min_tokens, logit_bias, "
                             "allowed_token_ids, bad_words or guided decoding")

    def _verify_v04_fields(self) -> None:
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n, MAX_N, extra=f" (at least n={self.n}) or None")
        if self.seed is not None:
            # Sample i of a request draws from a generator seeded with seed + i.
            count = self.num_samples
            name = "n" if self.best_of is None else "best_of"
            _check_int("seed", self.seed, 0, MAX_SEED - (count - 1),
                       extra=f" (seed + {name} - 1 must not exceed {MAX_SEED})" if count > 1 else "")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_finite_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not _is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, extra=f" (at most max_tokens={self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, extra=" or None")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, "
                             f"got {self.include_stop_str_in_output!r}")

    def _verify_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias's token id", token, 0, MAX_INT32)
                if not _is_finite_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias for token {token} must be a number in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if (not isinstance(self.bad_words, (list, tuple))
                    or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError(f"guided_decoding must be a GuidedDecodingParams, "
                                 f"got {type(self.guided_decoding).__name__}")
            self.guided_decoding.verify()
            if self.ignore_eos:
                # The grammar ends a complete output by allowing EOS alone; ignoring it would
                # leave nothing to draw.
                raise ValueError("ignore_eos cannot be combined with guided decoding: "
                                 "a complete output ends with EOS")

    @property
    def has_constraints(self) -> bool:
        """Whether the sampler must mask or bias this request's logits beyond min_tokens."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None
                or self.guided_decoding is not None)

    @property
    def num_samples(self) -> int:
        """How many samples the request draws: ``best_of``, or ``n`` when best_of is None."""
        return self.n if self.best_of is None else self.best_of

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must look at the sequence's tokens (v0.4's ``do_penalties``)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
