"""What each of the reader's components serves in a run, and what its answers must be.

For every component: which calls count as the work it served (the allocator's ``allocate``, the
sampler's ``__call__``, a round class's rounds …), how one call counts (blocks moved, rows
sampled), how the report says the total ("your allocator allocated 30 blocks"), and the checks
of the values it returns that the package then relies on, each a function that gives the
complaint ("returned None; it must return …") or None. ``contain`` wraps the components with
these; the checks are cheap on purpose: they run on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tinyserve.block_manager import AllocStatus, BlockSpaceManager

Check = Callable[[object, tuple], "str | None"]  # (the value returned, the call's arguments) -> complaint


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bool(result, args) -> str | None:
    if isinstance(result, bool) or type(result).__name__ == "bool_":  # numpy's bool is a bool too
        return None
    return f"returned {_shown(result)}; it must return True or False"


def _victim(result, args) -> str | None:
    running = list(args[0]) if args else []
    if any(result is group for group in running):
        return None
    n = len(running)
    return f"returned {_shown(result)}; it must return one of the {n} group{'' if n == 1 else 's'} it was given"


def _block(result, args) -> str | None:
    if result is not None and hasattr(result, "block_number"):
        return None
    return f"returned {_shown(result)}; it must return a block (a PhysicalTokenBlock) or raise OutOfBlocksError"


def _count(result, args) -> str | None:
    if isinstance(result, int) and not isinstance(result, bool) and result >= 0:
        return None
    return f"returned {_shown(result)}; it must return a number of blocks (an int, 0 or more)"


def _status(result, args) -> str | None:
    if isinstance(result, AllocStatus):
        return None
    return f"returned {_shown(result)}; it must return an AllocStatus (OK, LATER or NEVER)"


def _copy_order(result, args) -> str | None:
    if result is None or (isinstance(result, tuple) and len(result) == 2):
        return None
    return f"returned {_shown(result)}; it must return None or a (source, destination) pair of block numbers"


def _mapping(result, args) -> str | None:
    if isinstance(result, dict):
        return None
    return f"returned {_shown(result)}; it must return a dict of block numbers (source to destination)"


def _round(result, args) -> str | None:
    from tinyserve.scheduler_outputs import SchedulerOutputs

    if isinstance(result, SchedulerOutputs):
        return None
    return f"returned {_shown(result)}; it must return the round's SchedulerOutputs"


def _schedule(result, args) -> str | None:
    from tinyserve.scheduler_outputs import SchedulerOutputs

    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], SchedulerOutputs):
        return None
    return f"returned {_shown(result)}; it must return (the groups' metadata, the SchedulerOutputs)"


def _samples(result, args) -> str | None:
    requests = args[1] if len(args) > 1 else []
    if isinstance(result, (list, tuple)) and len(result) == len(requests):
        return None
    got = f"{len(result)} results" if isinstance(result, (list, tuple)) else _shown(result)
    return f"returned {got} for {len(requests)} requests; it must return one list of token ids per request"


def _model_input(result, args) -> str | None:
    missing = [a for a in ("input_ids", "positions", "attn_metadata", "sample_indices") if not hasattr(result, a)]
    if not missing:
        return None
    return f"returned {_shown(result)}; it must return a ModelInput (it lacks {', '.join(missing)})"


def _outputs(result, args) -> str | None:
    if isinstance(result, list):
        return None
    return f"returned {_shown(result)}; it must return the list of this step's RequestOutputs"


def _blocks_moved(args) -> int:
    """How many blocks one cache order moves: a swap's mapping, or a copy's lists of destinations."""
    order = args[0] if args else {}
    if not isinstance(order, dict):
        return 0
    return sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in order.values())


def _rows(args) -> int:
    return len(args[1]) if len(args) > 1 else 0


@dataclass(frozen=True)
class Served:
    """How one component's service is counted, said and checked. ``counted`` names the methods
    whose calls count ("__call__" for a function); ``rounds``: the count is of the scheduler's
    rounds in which any of the component's methods ran."""

    phrase: str  # "allocated {n} block{s}"
    note: str = ""  # what one count is, said after a count that is not 0
    counted: tuple[str, ...] = ()
    checks: dict[str, Check] = field(default_factory=dict)
    sizes: dict[str, Callable[[tuple], int]] = field(default_factory=dict)
    rounds: bool = False
    policy: str = ""  # a round's policy: a run under other policies never calls it

    def says(self, n: int) -> str:
        text = self.phrase.format(n=n, s="" if n == 1 else "s", es="" if n == 1 else "es")
        return f"{text} ({self.note})" if n and self.note else text


ROUND_CHECKS: dict[str, Check] = {"_schedule_round": _round, "_schedule_vllm": _round, "_schedule_mixed": _round,
                                  "_schedule_v1": _round, "schedule": _schedule}
# The block manager's interface: the public methods of the package's class, which the scheduler calls.
MANAGER_METHODS = tuple(sorted(n for n, v in vars(BlockSpaceManager).items() if callable(v) and not n.startswith("_")))

SERVED: dict[str, Served] = {
    "allocator": Served("allocated {n} block{s}", "GPU and CPU", ("allocate",),
                        {"allocate": _block, "get_num_free_blocks": _count}),
    "block_manager": Served("answered {n} call{s} of the scheduler", "", MANAGER_METHODS,
                            {"can_allocate": _status, "can_append_slot": _bool, "can_swap_in": _bool,
                             "can_swap_out": _bool, "append_slot": _copy_order, "swap_in": _mapping,
                             "swap_out": _mapping, "get_num_free_gpu_blocks": _count}),
    "admission": Served("was asked {n} time{s}", "whether to admit the group at the head of waiting", ("__call__",),
                        {"__call__": _bool}),
    "orca_round": Served("ran {n} round{s}", checks=ROUND_CHECKS, rounds=True, policy="orca"),
    "scheduler_round": Served("ran {n} round{s}", checks=ROUND_CHECKS, rounds=True, policy="vllm"),
    "v1_round": Served("ran {n} round{s}", checks=ROUND_CHECKS, rounds=True, policy="v1"),
    "victim": Served("chose {n} victim{s}", "", ("__call__",), {"__call__": _victim}),
    "cache_engine": Served("moved {n} block{s}", "swapped out, swapped in and copied", ("swap_out", "swap_in", "copy"),
                           sizes={"swap_out": _blocks_moved, "swap_in": _blocks_moved, "copy": _blocks_moved}),
    "attention": Served("ran {n} time{s}", "once per layer per step", ("forward",)),
    "input_builder": Served("packed {n} batch{es}", "", ("__call__",), {"__call__": _model_input}),
    "sampler": Served("sampled {n} time{s}", "once per sequence per step", ("__call__",), {"__call__": _samples},
                      sizes={"__call__": _rows}),
    "engine_step": Served("ran {n} step{s}", "", ("step",), {"step": _outputs}),
    "beam_select": Served("decided {n} beam step{s}", "", ("__call__",)),
}
NOT_COUNTED = Served("served {n} call{s}")
