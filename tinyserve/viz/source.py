"""Render the package's own source in a notebook, at the stage of the chapter that shows it.

The book never pastes code: each listing is read from the package when the chapter runs. A
chapter shows an object as that chapter builds it, so code that a later chapter adds is folded
away. Such code is marked once in the package, by two whole-line comments::

    # >>> chapter 12: prefix caching
    ...the lines chapter 12 adds...
    # <<<

``show(obj, chapter=N)`` shows every block whose chapter is at most N without its two marker
lines, and folds every later block into one line at the block's indentation,
``# ⋯ chapter 12: prefix caching (7 lines)``. Without ``chapter=`` it takes the notebook's
chapter, set once by ``set_chapter(N)`` in the chapter's first cell; with no chapter at all it
shows the finished package (every block open). Markers are strict: one that is malformed, nested,
unclosed or empty raises ValueError, and ``tests/test_listings.py`` checks every package file.

A listing carries a machine-readable id (module, qualified name, chapter) in its output's
metadata, so a test can render every committed listing again and catch a stale book.

``show_solution(path, name)`` shows one definition of a chapter's solutions file
(``chapters/solutions/chNN.py``, not part of the package) the same way, highlighted with the
file's line numbers, with its own id (path and name) in the output's metadata.
"""

from __future__ import annotations

import html
import importlib
import inspect
import json
import linecache
import os
import re
from abc import ABC, abstractmethod

from tinyserve.lab.solution_source import definition_span
from tinyserve.viz.markers import Block, parse_markers

# The key of a listing's id in its output metadata, and the HTML comment that repeats it.
METADATA_KEY = "tinyserve.listing"
# The same for a solution's listing (``show_solution``).
SOLUTION_KEY = "tinyserve.solution"
FOLD_MARK = "⋯"

_NOTEBOOK_NAME = re.compile(r"(?:^|/)(\d\d)_[^/]*\.ipynb$")

_chapter: int | None = None
_UNSET = object()


def _check_chapter(chapter: object) -> int | None:
    if chapter is None:
        return None
    if isinstance(chapter, bool) or not isinstance(chapter, int) or not 0 <= chapter <= 99:
        raise ValueError(f"chapter must be a chapter number from 0 to 99 or None, got {chapter!r}")
    return chapter


def set_chapter(chapter: int | None) -> None:
    """Make ``chapter`` the stage at which ``show()`` renders from now on (each chapter's first
    cell calls it; None shows the finished package)."""
    global _chapter
    _chapter = _check_chapter(chapter)


def current_chapter() -> int | None:
    """The chapter ``show()`` uses when it is not given one: the one set by ``set_chapter``,
    else the number of the running notebook's file (when the Jupyter server names it), else None."""
    if _chapter is not None:
        return _chapter
    names = [os.environ.get("JPY_SESSION_NAME", "")]
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            names.append(str(ip.user_ns.get("__session__", "")))
    except ImportError:
        pass
    for name in names:
        m = _NOTEBOOK_NAME.search(name)
        if m:
            return int(m.group(1))
    return None


def _unwrap_kernel(obj: object) -> object:
    # A @triton.jit kernel wraps its Python function in ``.fn``; show the function.
    return getattr(obj, "fn", obj) if type(obj).__module__.startswith("triton") else obj


def resolve(module: str, qualname: str) -> object:
    """The object a listing id names: ``qualname`` looked up attribute by attribute in ``module``."""
    obj: object = importlib.import_module(module)
    if qualname:
        for part in qualname.split("."):
            if part == "<locals>" or not hasattr(obj, part):
                raise ValueError(f"listing id: {module}.{qualname} cannot be looked up "
                                 f"({part!r} is not an attribute of {obj!r})")
            obj = getattr(obj, part)
    return _unwrap_kernel(obj)


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _listing_html(rows: list[tuple[int, str, bool]], code: str, last_line: int, comment: str, title: str,
                  where: str) -> str:
    """Rows of source as the book shows listings: highlighted, with the file's line numbers, under
    a bold title; fold rows in grey italics."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    lit = highlight(code, PythonLexer(stripnl=False, ensurenl=True),
                    HtmlFormatter(noclasses=True, nowrap=True)).split("\n")
    width = len(str(last_line))
    out = []
    for (lineno, text, fold), code_html in zip(rows, lit):
        if fold:
            code_html = (f"<span style='color:#777;font-style:italic;background:#eef1f5'>"
                         f"{html.escape(text)}</span>")
        out.append(f"<span style='color:#aaa;user-select:none'>{lineno:>{width}} </span>{code_html}")
    return (f"<div style='font-size:85%'>{comment}"
            f"<b>{html.escape(title)}</b> <span style='color:#888'>{html.escape(where)}</span>"
            f"<pre style='line-height:125%;margin:0.3em 0'>{chr(10).join(out)}</pre></div>")


def _display_once(view) -> None:
    # show() displays at once, so that several listings in one cell all appear. When the
    # view is also the cell's last expression, IPython would display it a second time.
    from IPython import get_ipython
    from IPython.display import display

    ip = get_ipython()
    count = getattr(ip, "execution_count", None)
    if count is not None and getattr(view, "_shown_at", None) == count:
        return
    view._shown_at = count
    data, metadata = view._repr_mimebundle_()
    display(data, raw=True, metadata=metadata)


class _Listing(ABC):
    """What a listing and a solution share: plain text for a terminal, highlighted HTML with an
    id in the output's metadata (``_key``) for Jupyter, by which tests render it again."""

    _key: str
    name: str
    code: str
    rows: list[tuple[int, str, bool]]
    last_line: int

    @abstractmethod
    def header(self) -> str:
        """The first line of the plain-text view."""

    @abstractmethod
    def _ident(self) -> dict:
        """What the view shows, enough to render it again (the output's metadata under ``_key``)."""

    @abstractmethod
    def _subtitle(self) -> str:
        """Where the code comes from, under the title of the HTML view."""

    def __repr__(self) -> str:
        return f"{self.header()}\n{self.code}"

    def _repr_html_(self) -> str:
        tag = json.dumps(self._ident()).replace("--", "- -")
        return _listing_html(self.rows, self.code, self.last_line, f"<!-- {self._key} {tag} -->", self.name,
                             self._subtitle())

    def _repr_mimebundle_(self, include=None, exclude=None) -> tuple[dict, dict]:
        return ({"text/plain": repr(self), "text/html": self._repr_html_()}, {self._key: self._ident()})

    def _ipython_display_(self) -> None:
        _display_once(self)


class SourceView(_Listing):
    """The source of one object at one chapter's stage: highlighted with the file's own line
    numbers in Jupyter, plain text elsewhere. ``code`` is the rendered text, ``rows`` the lines
    with their line numbers in the file (a fold row carries its opening marker's number)."""

    _key = METADATA_KEY

    def __init__(self, obj: object, chapter: int | None = None) -> None:
        obj = _unwrap_kernel(obj)
        self.obj = obj
        self.chapter = _check_chapter(chapter)
        if inspect.ismodule(obj):
            self.module, self.qualname = obj.__name__, ""
        else:
            self.module = getattr(obj, "__module__", None) or "?"
            self.qualname = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
        self.name = f"{self.module}.{self.qualname}" if self.qualname else self.module
        # getsource follows a decorator's __wrapped__ to the real function; getsourcefile does not.
        target = inspect.unwrap(obj) if callable(obj) else obj
        self.file = inspect.getsourcefile(target) or inspect.getfile(target)
        src_lines, first = inspect.getsourcelines(obj)
        self.first_line = max(first, 1)  # a module starts at line 0 for inspect
        self.last_line = self.first_line + len(src_lines) - 1
        file_lines = linecache.getlines(self.file)  # what inspect itself read
        self.rows = self._fold(src_lines, parse_markers(file_lines, self._where_file()))
        self.code = "".join(text + "\n" for _, text, _ in self.rows)

    # -- rendering at the chapter's stage -----------------------------------------------------
    def _fold(self, src_lines: list[str], blocks: list[Block]) -> list[tuple[int, str, bool]]:
        a, b = self.first_line, self.last_line
        inside: dict[int, Block] = {}
        for blk in blocks:
            if blk.close_line < a or blk.open_line > b:
                continue
            if a <= blk.open_line and blk.close_line <= b:
                inside[blk.open_line] = blk
            elif blk.open_line < a and blk.close_line > b:
                if self._folds(blk) and not blk.fold:  # a listing of what a fold holds shows it
                    raise ValueError(f"{self.name} belongs to chapter {blk.chapter} ({blk.feature}); "
                                     f"a listing at chapter {self.chapter} cannot show it")
            else:
                raise ValueError(f"{self._where_file()}:{blk.open_line}: the chapter {blk.chapter} "
                                 f"block straddles the edge of {self.name} (lines {a}-{b})")
        marker_lines = {n for blk in inside.values() for n in (blk.open_line, blk.close_line)}
        body = [ln for i, ln in enumerate(src_lines, a) if i not in marker_lines and ln.strip()]
        strip = min((_indent_of(ln) for ln in body), default=0)
        rows: list[tuple[int, str, bool]] = []
        n = a
        while n <= b:
            blk = inside.get(n)
            if blk is not None and self._folds(blk):
                indent = blk.indent[strip:]
                lines = "line" if blk.num_lines == 1 else "lines"
                what = blk.feature if blk.fold else f"chapter {blk.chapter}: {blk.feature}"
                rows.append((n, f"{indent}# {FOLD_MARK} {what} ({blk.num_lines} {lines})", True))
                n = blk.close_line + 1
                continue
            if n not in marker_lines:
                rows.append((n, src_lines[n - a].rstrip("\r\n")[strip:], False))
            n += 1
        return rows

    def _folds(self, blk: Block) -> bool:
        # A fold block folds in every chapter; only the finished package (chapter None) shows it.
        return self.chapter is not None and (blk.fold or blk.chapter > self.chapter)

    # -- output -------------------------------------------------------------------------------
    def _where_file(self) -> str:
        path = self.file or "?"
        if "tinyserve/" in path:
            return "tinyserve/" + path.rsplit("tinyserve/", 1)[1]
        return os.path.basename(path)

    def _where(self) -> str:
        return f"{self._where_file()}:{self.first_line}-{self.last_line}"

    def _stage(self) -> str:
        return "finished package" if self.chapter is None else f"at chapter {self.chapter}"

    @property
    def listing_id(self) -> dict:
        """What this listing shows, enough to render it again: see ``from_id``."""
        return {"module": self.module, "qualname": self.qualname, "chapter": self.chapter}

    @classmethod
    def from_id(cls, listing_id: dict) -> SourceView:
        """Render again the listing that ``listing_id`` (a committed output's metadata) names."""
        return cls(resolve(listing_id["module"], listing_id["qualname"]), listing_id["chapter"])

    def header(self) -> str:
        """The first line of the plain-text listing, by which tests recognise listings."""
        return f"# {self.name}  ({self._where()}, {self._stage()})"

    def _ident(self) -> dict:
        return self.listing_id

    def _subtitle(self) -> str:
        return f"{self._where()} · {self._stage()}"


def _displayed(view):
    """``view``, displayed first when a notebook's kernel runs this (outside one, only returned)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return view
    if get_ipython() is not None:
        view._ipython_display_()
    return view


def show(obj: object, chapter: int | None = _UNSET) -> SourceView:  # type: ignore[assignment]
    """Show the source of ``obj`` (a function, class, method or module) as chapter ``chapter``
    builds it: later chapters' marked blocks fold into one line each. Without ``chapter`` the
    notebook's (``set_chapter``) is used. In a notebook it is displayed at once, so every call
    of a cell appears; the returned view has ``code`` and a plain-text ``repr``."""
    view = SourceView(obj, current_chapter() if chapter is _UNSET else chapter)
    return _displayed(view)


class SolutionView(_Listing):
    """One top-level definition of a chapter's solutions file, rendered as a listing is:
    highlighted with the file's line numbers in Jupyter, plain text elsewhere."""

    _key = SOLUTION_KEY

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = str(path), name
        self.first_line, self.last_line, source = definition_span(path, name)
        self.rows = [(n, text, False) for n, text in enumerate(source.splitlines(), self.first_line)]
        self.code = "".join(text + "\n" for _, text, _ in self.rows)

    @property
    def solution_id(self) -> dict:
        """What this listing shows, enough to render it again: ``SolutionView(**solution_id)``."""
        return {"path": self.path, "name": self.name}

    def header(self) -> str:
        return f"# {self.name}, the book's solution ({self.path}, lines {self.first_line}-{self.last_line})"

    def _ident(self) -> dict:
        return self.solution_id

    def _subtitle(self) -> str:
        return f"{self.path}:{self.first_line}-{self.last_line} · the book's solution"


def show_solution(path: str, name: str) -> SolutionView:
    """Show the top-level class or function ``name`` of the solutions file ``path`` (relative to
    the notebook: ``"solutions/ch02.py"``) as ``show`` shows the package's code. In a notebook it
    is displayed at once; the returned view has ``code`` and a plain-text ``repr``."""
    view = SolutionView(path, name)
    return _displayed(view)
