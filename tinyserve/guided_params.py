"""GuidedDecodingParams: the shape a request's output must take (vLLM's name and fields).

One of five kinds, exactly one per request: ``json`` (a JSON schema, as a dict or its text),
``json_object`` (any JSON object), ``regex`` (the whole output matches it), ``choice`` (the output
is one of these strings, verbatim) or ``grammar`` (a Lark grammar, in llguidance's dialect). The
sampler enforces it with a token mask (``tinyserve.grammar``); this module only checks the
request's shape, so a malformed one is a ValueError where the request is made. Whether a schema or
a regex can be compiled is checked when the engine takes the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class GuidedDecodingParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"guided decoding takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(chosen) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"guided json: the schema is not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"guided json must be a JSON schema object, got {type(self.json).__name__}")
        if self.json_object not in (True, False):
            raise ValueError(f"guided json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"guided choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A text that identifies the grammar (requests with the same key share one compilation).
        Not sort_keys: a schema's property order is the order the output writes them in, so two
        schemas that differ only in it are different grammars."""
        return json.dumps([self.kind, getattr(self, self.kind)])
