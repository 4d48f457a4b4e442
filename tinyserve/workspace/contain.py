"""Running the reader's code contained: each call of a reader's component counted, its answers
checked, every round bounded in time, and whatever it raises turned into one line of a report.

``build_scheduler`` and ``build_engine`` wrap the reader's parts with a ``Tracker``: a function
(``can_admit``, ``choose_victim``, ``prepare_inputs``) is wrapped as it is passed in; a class
(or an instance's class) gets its own methods wrapped in place, the methods its module defines
and never the package's (a freshly loaded module's classes belong to this run alone). The
wrappers keep a stack of the reader's methods that are running, so that a timeout or an error
names the component, and count the calls that ``served`` says are its work.

``contained(tracker, run)`` runs the reader's side of "your engine so far" or the capstone:
any exception, ``SystemExit`` and ``KeyboardInterrupt`` included, becomes the problem line, and
in the main thread (where a Jupyter kernel runs its cells) a ``SIGALRM`` timer stops a round
that takes longer than the tracker's bound ("your scheduler_round (_admit_waiting) did not
return within 10 s in round 3 (a loop that never ends?)"). Elsewhere (a thread, or a system
without ``setitimer``) signals cannot reach the run, and it runs unbounded.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
import types
from collections import Counter

from tinyserve.workspace.served import NOT_COUNTED, SERVED
from tinyserve.workspace.store import COMPONENTS, MODULE_PREFIX

# The bound on one round of the reader's run. Without a model a round of the seed workloads takes
# well under a millisecond of the package's code (and the reader's scheduler is the same kind of
# Python), so 10 s is thousands of times too much for any correct answer on a busy 2-core
# machine, and still a short wait before the chapter goes on.
ROUND_TIMEOUT_S = 10.0
# With a model a round is an engine step that runs it. The capstone on SmolLM2-135M with the
# book's solutions as the reader's parts (attention included), on 2 busy CPU cores, took 0.37 s
# a step on average and 0.94 s at most (the package's engine 0.27 s and 0.93 s); 60 s is sixty
# times the slowest, room for a reader's attention written as a slow Python loop, and stops
# only a step that will never end. Loading and constructing the reader's parts (the engine
# allocates its cache) share this bound.
STEP_TIMEOUT_S = 60.0
# A timeout the reader's code swallowed (``except BaseException``) is raised again this soon.
REPEAT_S = 1.0


class ComponentError(Exception):
    """A reader's component returned a value the package cannot use (the message names it)."""


class RoundTimeout(BaseException):
    """A round ran past the bound. A BaseException, so that ``except Exception`` in the reader's
    loop does not swallow it."""


def component_of(obj) -> str | None:
    """The workspace component whose module defines ``obj`` (a class or function), else None."""
    module = getattr(obj, "__module__", None) or ""
    prefix = MODULE_PREFIX + "."
    name = module[len(prefix):] if isinstance(module, str) and module.startswith(prefix) else None
    return name if name in COMPONENTS else None


class Tracker:
    """The calls each reader component served in one run, which of them is running, the round,
    and the run's time bound (``timeout_s``; None: unbounded)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()
        self.stack: list[tuple[str, str]] = []  # (component, method) of the reader's code now running
        self.touched: set[str] = set()  # components whose code ran in the current schedule()
        self.round = 0
        self.rounds_by_schedule = True  # False when the caller's loop of engine steps starts rounds
        self.armed = False
        self.report = None  # the Report of the build that uses this tracker

    def begin_round(self) -> None:
        """Count a new round and give it the whole bound."""
        self.round += 1
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)

    def where(self) -> str:
        return f"in round {self.round}" if self.round else "before the first round"

    def running(self, name: str, method: str) -> _Running:
        """A context in which ``name``'s ``method`` counts as running (e.g. its import)."""
        return _Running(self, name, method)

    def timeout_line(self) -> str:
        if self.stack:
            name, method = self.stack[-1]
            outer = [f"your {n}" for n, _ in reversed(self.stack[:-1]) if n != name]
            called = f", called from {' in '.join(dict.fromkeys(outer))}" if outer else ""
            return (f"your {name} ({method}) did not return within {self.timeout_s:g} s {self.where()} "
                    f"(a loop that never ends?){called}")
        stage = f"round {self.round}" if self.round else "its start"
        return (f"your run did not finish {stage} within {self.timeout_s:g} s (in the package's code, on the "
                f"state your parts left)")


class _Running:
    def __init__(self, tracker: Tracker, name: str, method: str) -> None:
        self.tracker, self.frame = tracker, (name, method)

    def __enter__(self) -> None:
        self.tracker.stack.append(self.frame)

    def __exit__(self, kind, error, tb) -> None:
        self.tracker.stack.pop()
        if error is not None:
            _blame(error, *self.frame)


def _blame(error: BaseException, name: str, method: str) -> None:
    """Remember the innermost reader method an exception came through (the first to see it)."""
    if getattr(error, "_tinyserve_in", None) is None:
        try:
            error._tinyserve_in = (name, method)
        except AttributeError:  # an exception type that takes no attributes
            pass


def _tracked(tracker: Tracker, name: str, method: str, fn, *, bound: bool, label: str | None = None):
    """``fn`` wrapped: on the stack while it runs, its answer checked, its service counted.
    ``bound``: its first argument is self (or cls), which the checks do not see."""
    served = SERVED.get(name, NOT_COUNTED)
    check, size = served.checks.get(method), served.sizes.get(method)
    counted = method in served.counted
    label = label or method

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracker.stack.append((name, label))
        tracker.touched.add(name)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            _blame(e, name, label)
            raise
        finally:
            tracker.stack.pop()
        given = args[1:] if bound else args
        if check is not None:
            complaint = check(result, given)
            if complaint:
                raise ComponentError(f"your {name} ({label}) {complaint}")
        if counted:
            tracker.counts[name] += size(given) if size else 1
        return result

    wrapper.__tinyserve_tracked__ = fn
    return wrapper


def track_class(tracker: Tracker, cls: type) -> type:
    """Wrap, in place, the methods that the reader's classes in ``cls``'s MRO define (each under
    the component whose module defines it); the package's classes are left alone."""
    for klass in cls.__mro__:
        name = component_of(klass)
        if name is None:
            continue
        for attr, value in list(vars(klass).items()):
            if attr.startswith("__") and attr not in ("__init__", "__call__"):
                continue
            kind = type(value) if isinstance(value, (staticmethod, classmethod)) else None
            fn = value.__func__ if kind else value
            if not isinstance(fn, types.FunctionType):
                continue
            fn = getattr(fn, "__tinyserve_tracked__", fn)  # wrapped by an earlier build: wrap anew
            wrapper = _tracked(tracker, name, attr, fn, bound=kind is not staticmethod)
            setattr(klass, attr, kind(wrapper) if kind else wrapper)
    return cls


def track(tracker: Tracker, name: str, obj):
    """The reader's component ``name`` ready to be counted: a class with its methods tracked, an
    instance of a reader's class the same, a function of the reader's wrapped."""
    if isinstance(obj, type):
        return track_class(tracker, obj)
    if component_of(type(obj)) is not None:  # an instance of the reader's class: its class's methods
        track_class(tracker, type(obj))  # count, __call__ included (the object keeps its attributes)
        return obj
    if callable(obj) and "__call__" in SERVED.get(name, NOT_COUNTED).counted and component_of(obj) is not None:
        return _tracked(tracker, name, "__call__", obj, bound=False, label=getattr(obj, "__name__", None))
    return obj  # the package's object: none of the reader's code to count


def track_factory(tracker: Tracker, name: str, obj):
    """A class (tracked), or a factory function whose products' classes get tracked."""
    if isinstance(obj, type) or not callable(obj):
        return track(tracker, name, obj)

    @functools.wraps(obj)
    def make(*args, **kwargs):
        with tracker.running(name, getattr(obj, "__name__", "factory")):
            product = obj(*args, **kwargs)
        if component_of(type(product)) is not None:
            track_class(tracker, type(product))
        return product

    return make


def track_schedule(tracker: Tracker, scheduler) -> None:
    """Count, on this scheduler alone, each round in which a reader's round class's code ran; the
    simulator's rounds start at ``schedule()`` (an engine's at its step, see ``begin_round``)."""
    schedule = scheduler.schedule

    def counted_schedule():
        if tracker.rounds_by_schedule:
            tracker.begin_round()
        tracker.touched = set()
        try:
            return schedule()
        finally:
            for name in tracker.touched:
                if SERVED.get(name, NOT_COUNTED).rounds:
                    tracker.counts[name] += 1

    scheduler.schedule = counted_schedule


def problem_line(tracker: Tracker, error: BaseException) -> str:
    """The report's line for what stopped the reader's run."""
    if isinstance(error, RoundTimeout):
        return str(error)
    if isinstance(error, ComponentError):
        return f"{error} ({tracker.where()})"
    blamed = getattr(error, "_tinyserve_in", None)
    who = f" while your {blamed[0]} ({blamed[1]}) was running" if blamed else ""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"your run raised {text} ({tracker.where()}){who}"


def contained(tracker: Tracker, run, *args, **kwargs):
    """``run(*args, **kwargs)``, bounded and contained: ``(its result, None)``, or ``(None, the
    problem line)`` if it raised anything at all or ran past the bound."""
    with _Bound(tracker):
        try:
            return run(*args, **kwargs), None
        except BaseException as e:  # the reader's code: a report, never a crash of the chapter
            tracker.armed = False
            return None, problem_line(tracker, e)


class _Bound:
    """SIGALRM armed with the tracker's bound while the run lasts, the previous handler and
    timer restored after it. Signals are delivered to the main thread only: in any other thread
    (or without setitimer, on Windows) the run is left unbounded."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.usable = (tracker.timeout_s is not None and hasattr(signal, "setitimer")
                       and threading.current_thread() is threading.main_thread())

    def _alarm(self, signum, frame) -> None:
        if not self.tracker.armed:
            return
        signal.setitimer(signal.ITIMER_REAL, REPEAT_S)  # again, should the reader's code swallow this one
        raise RoundTimeout(self.tracker.timeout_line())

    def __enter__(self) -> _Bound:
        if self.usable:
            self.previous = signal.signal(signal.SIGALRM, self._alarm)
            self.previous_timer = signal.setitimer(signal.ITIMER_REAL, self.tracker.timeout_s)
            self.started = time.monotonic()
            self.tracker.armed = True
        return self

    def __exit__(self, *exc) -> None:
        if self.usable:
            self.tracker.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            # None: a handler set outside Python, which cannot be put back; the default is the closest.
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous)
            delay, interval = self.previous_timer
            if delay > 0:  # someone else's timer (pytest-timeout's, say) runs on, less the time spent here
                signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - self.started), 0.001), interval)
