"""The markers in the package's source: ``# >>> chapter NN: feature`` ... ``# <<<`` around what a
later chapter adds, and ``# >>> fold: what`` ... ``# <<<`` around what a listing never shows in
full (validation, a safety net, a hook's seam: the chapter's algorithm reads without it).

``source.show`` folds the blocks of later chapters, and every fold block, to one line; this
module only finds them, strictly: a marker that is malformed, nested, unclosed or empty is a
ValueError naming the file and line.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

_OPEN = re.compile(r"# >>> (?:chapter (\d\d)|(fold)): (\S.*?)\s*")
_CLOSE = re.compile(r"# <<<\s*")


@dataclass(frozen=True)
class Block:
    """One marked block of a file: its marker lines (1-based, inclusive) and its chapter (0 for a
    fold block, which ``fold`` marks)."""

    open_line: int
    close_line: int
    chapter: int
    feature: str
    indent: str
    fold: bool = False

    @property
    def num_lines(self) -> int:
        return self.close_line - self.open_line - 1


def parse_markers(lines: list[str], where: str = "<source>") -> list[Block]:
    """The marked blocks of a file given as lines; any misuse of the markers raises ValueError
    naming ``where`` and the line."""
    text = "".join(lines)
    comments: list[tuple[int, int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.start[1], tok.string))
    except (tokenize.TokenError, SyntaxError) as e:
        raise ValueError(f"{where}: cannot tokenize: {e}") from e
    blocks: list[Block] = []
    current: tuple[int, int, str, str] | None = None  # open line, chapter, feature, indent
    for lineno, col, comment in comments:
        if not comment.startswith(("# >>>", "# <<<")):
            continue
        line = lines[lineno - 1]
        if line[:col].strip():
            raise ValueError(f"{where}:{lineno}: a chapter marker must be a whole-line comment")
        if comment.startswith("# >>>"):
            m = _OPEN.fullmatch(comment)
            if not m:
                raise ValueError(f"{where}:{lineno}: malformed marker {comment!r}; "
                                 "the form is '# >>> chapter NN: feature name' or '# >>> fold: what'")
            if current is not None:
                raise ValueError(f"{where}:{lineno}: marker opens inside the block opened at line "
                                 f"{current[0]} (blocks do not nest)")
            current = (lineno, int(m.group(1) or 0), m.group(3), line[:col], bool(m.group(2)))
        else:
            if not _CLOSE.fullmatch(comment):
                raise ValueError(f"{where}:{lineno}: malformed marker {comment!r}; a block closes "
                                 "with '# <<<' alone")
            if current is None:
                raise ValueError(f"{where}:{lineno}: '# <<<' closes no open block")
            block = Block(current[0], lineno, *current[1:])
            if block.num_lines == 0:
                raise ValueError(f"{where}:{block.open_line}: empty {'fold' if block.fold else 'chapter'} block")
            blocks.append(block)
            current = None
    if current is not None:
        raise ValueError(f"{where}:{current[0]}: chapter block is never closed with '# <<<'")
    return blocks


def parse_file(path: str | Path) -> list[Block]:
    """The marked blocks of a source file (ValueError on any misuse of the markers)."""
    path = str(path)
    return parse_markers(Path(path).read_text(encoding="utf-8").splitlines(keepends=True), path)
