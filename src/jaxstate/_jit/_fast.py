"""A training loop's call as one generated function (`fast_call`). See README.md
beside this file.

A loop calls one function with arguments of one layout: which positions hold
arrays, which hold remembered objects, with which part keys, and which of them
reach the states (a model, and the optax state made from it, reach the same
ones). The generic path walks that layout on every call (`Memo.match`)
and then runs `execute`, a few hundred bytecodes in all: for a dispatch-bound step,
or a scan of a thousand small iterations, that Python is a tenth or more of the
call. Once a layout has matched twice, it is compiled into straight-line Python with
the keys, the program and the arrangement of the program's inputs bound as names:
the same checks in the same order, the same effect on the memo. Anything but the
plain case (an argument that does not match, a program that is not
`Program.plain`, NaN debugging) returns `MISS` before it has changed anything, and
the call takes the generic path; what can only be seen after the program has run (a
state's first value, a failed check, an output to rebuild) is left to the
wrapper's `finish`.
"""

from collections.abc import Callable
from typing import Any

from .. import _jax
from .._core._lock import give, take
from ._parts import ARRAY_ROLE, EMPTY, roles, same
from ._program import calls_program, program_and_call, Undonate


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISS"


MISS: Any = _Miss()
"""What a fast call returns when the call is not its plain case."""


# Up to this many arrays of an argument, or state buffers, are named one by one.
NAMED = 8


def never(args: tuple) -> Any:
    """The fast call of a memo without a stable layout."""
    del args
    return MISS


def fast_call(wrapper: Any, memo: Any, last: Any) -> Callable[[tuple], Any]:
    """The call of `wrapper` for arguments laid out as `last`, the last call `memo`
    recorded. It takes the positional arguments and returns the call's output, or
    `MISS`."""
    fun = memo.fun
    names: dict[str, Any] = {
        "memo": memo,
        "FUN": fun,
        "EMPTY": EMPTY,
        "PROGRAM": last.program,
        "N_FIRST": last.n_first,
        "UNDONATED": wrapper.undonated,
        "FINISH": wrapper.finish,
        "MISS": MISS,
        "NEVER": never,
        "Undonate": Undonate,
        "_roles_get": roles.get,
        "_same": same,
        "ARRAY": ARRAY_ROLE,
        "_take": take,
        "_give": give,
        "_get_buf": _jax.get_buf,
        "_BUF_NAMES": _jax.BUF_NAMES,
        "_setattr": setattr,
        "_debug_nans": _jax.debug_nans,
        "_debug_infs": _jax.debug_infs,
    }
    keys = last.keys[2:]
    call = "FUN" if fun.storages else "EMPTY"
    checks, used = [], []
    # Each argument's arrays, as expressions; the function's first. A run of a few
    # is named one by one (a call with plain arguments costs JAX less than one
    # with `*`), a longer one unpacked.
    if len(fun.arrays) > NAMED:
        names["FUN_ARRAYS"] = tuple(fun.arrays)
        arrays = ["*FUN_ARRAYS"]
    else:
        # (The function's arrays are its part's: `memo.fun is FUN` checks them.)
        arrays = [f"F{j}" for j in range(len(fun.arrays))]
        names.update(zip(arrays, fun.arrays, strict=True))
    n_kept = len(arrays)  # (the kept run, for `donate="all-except-first"`)
    for i, key in enumerate(keys):
        a = f"a{i}"
        if key is None:
            # (A type not yet seen misses, and the generic path learns it.)
            checks.append(
                f"    if _roles_get(type({a})) != ARRAY:\n        return MISS"
            )
            arrays.append(a)
        else:
            names[f"K{i}"] = key
            checks.append(
                f"    e{i} = entries.get(id({a}))\n"
                f"    if (e{i} is None or e{i}[0]() is not {a}\n"
                f"            or e{i}[1].key is not K{i}):\n"
                "        return MISS\n"
                f"    g = e{i}[3]\n"
                "    if g is not None and not g.intact():\n"
                "        return MISS"
            )
            used.append(f"    used[id({a})] = e{i}")
            arrays += _unpacked(f"e{i}[2]", last.n_arrays[i + 2], checks)
            if last.call is not None and last.storages[i + 2]:
                # Several arguments reach states: each must bring the very states
                # it brought, which the last call's numbering names.
                names[f"S{i}"] = last.storages[i + 2]
                checks.append(
                    f"    if not _same(e{i}[1].storages, S{i}):\n        return MISS"
                )
            elif i + 2 == last.with_states:
                call = f"e{i}[1]"
        if i == 0:
            n_kept = len(arrays)
    if last.call is not None:
        names["CALL"] = last.call
        call = "CALL"
    n_holders = last.n_holders
    if n_holders <= NAMED:
        take_bufs = (
            [f"    ({''.join(f'h{j}, ' for j in range(n_holders))}) = holders"]
            if n_holders
            else []
        )
        bufs = [f"h{j}.{_jax.BUF}" for j in range(n_holders)]
        put = [f"        h{j}.{_jax.BUF} = out[{j}]" for j in range(n_holders)]
    else:
        take_bufs = []
        bufs = ["*map(_get_buf, holders)"]
        put = ["        any(map(_setattr, holders, _BUF_NAMES, out))"]
    # The program's inputs: the kept arrays, the state buffers, the donated arrays
    # (`_JitWrapper._split`).
    donate = wrapper.donate
    if donate == "none":
        inputs = [*arrays, *bufs]
    elif donate in ("all", "warn"):
        inputs = [*bufs, *arrays]
    else:
        # All but the function's, the keyword arguments' and the first argument's.
        inputs = [*arrays[:n_kept], *bufs, *arrays[n_kept:]]
    unpack = "".join(f"a{i}, " for i in range(len(keys)))
    source = "\n".join(
        [
            "def fast(args):",
            f"    if len(args) != {len(keys)} or memo.fun is not FUN:",
            "        return MISS",
            f"    ({unpack}) = args" if keys else "    pass",
            "    entries = memo.entries",
            *checks,
            "    program = PROGRAM",
            "    if not program.plain:",
            "        # (For good: a program stops being plain when it stops donating.)",
            "        memo.fast = NEVER",
            "        return MISS",
            "    if _debug_nans.value or _debug_infs.value:",
            "        return MISS",
            f"    call = {call}",
            "    holders = call.holders",
            f"    if len(holders) != {n_holders}:",
            "        return MISS",
            *take_bufs,
            "    used = memo.used",
            *used,
            "    memo.entries = used",
            "    ids = call.ids",
            "    opened = _take(ids)",
            "    try:",
            "        try:",
            f"            out = program.jitted({', '.join(inputs)})",
            "        except Undonate:",
            "            out = UNDONATED(",
            f"                program, call, [{', '.join(arrays)}], N_FIRST",
            "            )",
            *put,
            "    finally:",
            "        _give(ids, opened)",
            "    if out[-1].plain and not program.created:",
            "        memo.entries, memo.used = memo.used, {}",
            f"        return out[{n_holders}]",
            "    return FINISH(program, call, out)",
        ]
    )
    scope: dict[str, Any] = {}
    exec(compile(source, "<jaxstate fast call>", "exec"), names, scope)
    # It calls the program: when JAX traces again (arrays of new shapes), `_inner`
    # reads the program and the call from its frame.
    return calls_program(program_and_call)(scope["fast"])


def _unpacked(name: str, n: int, checks: list[str]) -> list[str]:
    """Expressions for the `n` arrays of the list `name`: one name each for a few
    (checked to be `n`), else one `*`."""
    if n > NAMED:
        return [f"*{name}"]
    if n == 0:
        checks.append(f"    if {name}:\n        return MISS")
        return []
    local = name.replace("[", "_").replace("]", "").lower()
    names = [f"{local}_{j}" for j in range(n)]
    checks.append(
        f"    if len({name}) != {n}:\n        return MISS\n"
        f"    ({''.join(f'{x}, ' for x in names)}) = {name}"
    )
    return names
