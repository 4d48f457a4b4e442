"""Render the package's own source in a notebook, so the book shows the code that runs."""

from __future__ import annotations

import inspect
import textwrap


class SourceView:
    """The source of one object, shown highlighted in Jupyter and as plain text elsewhere."""

    def __init__(self, obj: object) -> None:
        # A @triton.jit kernel wraps its Python function in ``.fn``; show the function.
        obj = getattr(obj, "fn", obj) if type(obj).__module__.startswith("triton") else obj
        self.obj = obj
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
        self.qualname = name if inspect.ismodule(obj) else f"{getattr(obj, '__module__', '?')}.{name}"
        self.code = textwrap.dedent(inspect.getsource(obj))
        # getsource follows a decorator's __wrapped__ to the real function; getsourcefile does not.
        self.file = inspect.getsourcefile(inspect.unwrap(obj) if callable(obj) else obj)
        self.first_line = inspect.getsourcelines(obj)[1]

    def __repr__(self) -> str:
        return f"# {self.qualname}  ({self._where()})\n{self.code}"

    def _where(self) -> str:
        path = self.file or "?"
        if "tinyserve/" in path:
            path = "tinyserve/" + path.split("tinyserve/", 1)[1]
        return f"{path}:{self.first_line}"

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        body = highlight(self.code, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=False))
        return (f"<div style='font-size:85%'><b>{self.qualname}</b> "
                f"<span style='color:#888'>{self._where()}</span>{body}</div>")


def show(obj: object) -> SourceView:
    """Return a view of ``obj``'s source (a function, class, method or module); as the last
    expression of a cell it renders highlighted."""
    return SourceView(obj)
