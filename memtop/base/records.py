"""`record`: `dataclasses.dataclass` for memtop's frozen records, without compiling their methods.

Python 3.10-3.12's dataclasses compile every method they generate with an `exec` of its own
(~0.1 ms each on a quiet box; a frozen class's `__setattr__` and `__delattr__` ~0.27 ms the
pair): of a frozen record's ~0.65 ms, ~0.5 ms is its `__repr__`, `__eq__`, `__hash__` and the
two guards, and the dashboard makes ~85 of memtop's before its first frame.  `record` takes
`dataclass`'s arguments and makes the same class (`fields`, `replace`, `asdict`, slots,
`__match_args__`, pickling, the generated `__init__`, `__dataclass_params__`), except that those
five methods of a frozen class are closures over its fields, made without compiling anything,
each doing what the generated one does: the same repr (the class's `__qualname__`, the `repr`
fields, "..." on recursion), equality only with the same class (`NotImplemented` otherwise) over
the `compare` fields as tuples, the hash of the same tuple, and the same `FrozenInstanceError`.
`tests/test_records.py` holds every memtop record to the class `dataclass` makes of it.

A class that writes any of those methods itself, or asks for `order` or `unsafe_hash`, is left
to `dataclass` for them.  The guards come from dataclasses' own `_frozen_get_del_attr` (its
signature as of 3.10-3.12), which `record` answers for the one class it is making, under a lock,
and only there: every other class, on any thread, gets dataclasses' own.  Python 3.13 makes a
class's methods in one `exec` (and compares field by field): there `record` is `dataclass`.

Only the viewer asks for this (`make_records_quickly`, from memtop/__main__.py's first lines,
before memtop.cli is imported): in a trainer, whose process is someone else's, the agent's
records are dataclasses' own and `dataclasses` is never touched.  So are the records of a
program that imports memtop's modules itself (the test suite's in-process tests; the tests of
`record` ask for it).

mypy reads `record` as `dataclasses.dataclass` (the same arguments, the same class).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from operator import attrgetter
from reprlib import recursive_repr
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any

# 3.13's dataclasses compile a class's methods in one exec (little left to save) and compare
# field by field, not as tuples: there `record` is dataclasses' `dataclass` itself.
_COMPILES_EACH_METHOD = sys.version_info < (3, 13)
_GUARDS_FROM_DATACLASSES = _COMPILES_EACH_METHOD and callable(
    getattr(dataclasses, "_frozen_get_del_attr", None)
)
_quickly = False  # make_records_quickly() was called: this process is memtop's viewer
_making = threading.RLock()
_class_being_made: list[type] = []


def make_records_quickly() -> None:
    """From now on `record` makes a frozen record's methods without compiling them (on Python
    3.10-3.12; a no-op on 3.13+).  For the viewer's start only: memtop/__main__.py."""
    global _quickly
    _quickly = _COMPILES_EACH_METHOD


def _repr_of(cls: type, names: Sequence[str]) -> Callable[[Any], str]:
    getters = tuple((f"{name}=", attrgetter(name)) for name in names)

    def __repr__(self: Any) -> str:
        return (
            self.__class__.__qualname__
            + "("
            + ", ".join([label + repr(get(self)) for label, get in getters])
            + ")"
        )

    __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
    return recursive_repr()(__repr__)


# The generated __eq__ and __hash__ of a class of n compared fields, compiled once for each n
# with placeholder names (bounded: one pair for each field count memtop's records have).  A
# class's own are that code with its fields' names put in: the same bytecode dataclasses
# compiles for it, so comparing and hashing records (the table's rows, the caches keyed by
# records) runs exactly as fast as before.
_compiled_for_arity: dict[int, tuple[CodeType, CodeType]] = {}


def _placeholder(i: int) -> str:
    return f"_memtop_field_{i}_"


def _tuple_source(obj: str, count: int) -> str:
    """dataclasses' `_tuple_str`: '(self.a,self.b,)', or '()'."""
    if not count:
        return "()"
    return "(" + ",".join(f"{obj}.{_placeholder(i)}" for i in range(count)) + ",)"


def _compiled(count: int) -> tuple[CodeType, CodeType]:
    codes = _compiled_for_arity.get(count)
    if codes is None:
        source = (
            "def __eq__(self, other):\n"
            " if other.__class__ is self.__class__:\n"
            f"  return {_tuple_source('self', count)}=={_tuple_source('other', count)}\n"
            " return NotImplemented\n"
            "def __hash__(self):\n"
            f" return hash({_tuple_source('self', count)})\n"
        )
        namespace: dict[str, Any] = {}
        exec(source, namespace)  # our own text: field names are never part of it
        codes = (namespace["__eq__"].__code__, namespace["__hash__"].__code__)
        _compiled_for_arity[count] = codes
    return codes


def _with_fields(
    code: CodeType, names: Sequence[str], module: dict[str, Any], qualname: str
) -> Any:
    renamed = {_placeholder(i): name for i, name in enumerate(names)}
    function = FunctionType(
        code.replace(co_names=tuple(renamed.get(name, name) for name in code.co_names)), module
    )
    function.__qualname__ = qualname
    return function


def _eq_and_hash_of(cls: type, compared: Sequence[str], hashed: Sequence[str]) -> tuple[Any, Any]:
    module = sys.modules[cls.__module__].__dict__ if cls.__module__ in sys.modules else {}
    eq_code = _compiled(len(compared))[0]
    hash_code = _compiled(len(hashed))[1]
    return (
        _with_fields(eq_code, compared, module, f"{cls.__qualname__}.__eq__"),
        _with_fields(hash_code, hashed, module, f"{cls.__qualname__}.__hash__"),
    )


def _frozen_guards(
    cls: type, fields: Sequence[dataclasses.Field[Any]], globals: dict[str, Any]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """What `dataclasses._frozen_get_del_attr` returns, for the class `record` is making."""
    if not _class_being_made or cls is not _class_being_made[-1]:
        return _generated_guards(cls, fields, globals)
    names = tuple(f.name for f in fields)
    frozen_error = dataclasses.FrozenInstanceError

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise frozen_error(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)  # type: ignore[arg-type]

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise frozen_error(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)  # type: ignore[arg-type]

    for guard in (__setattr__, __delattr__):
        guard.__qualname__ = f"{cls.__qualname__}.{guard.__name__}"
    return __setattr__, __delattr__


_generated_guards: Any = getattr(dataclasses, "_frozen_get_del_attr", None)


def _record(cls: type, options: dict[str, Any]) -> type:
    if not _quickly:
        return dataclasses.dataclass(cls, **options)  # type: ignore[no-any-return]
    own = cls.__dict__
    frozen = options.get("frozen", False)
    shares_repr = options.get("repr", True) and "__repr__" not in own
    shares_eq = (
        frozen
        and options.get("eq", True)
        and not options.get("order", False)
        and not options.get("unsafe_hash", False)
        and "__eq__" not in own
        and "__hash__" not in own
    )
    arguments = dict(options)
    if shares_repr:
        arguments["repr"] = False
    if shares_eq:
        arguments["eq"] = False  # with frozen: no __hash__ either (dataclasses' hash table)
    if frozen and _GUARDS_FROM_DATACLASSES:
        with _making:
            _class_being_made.append(cls)
            dataclasses._frozen_get_del_attr = _frozen_guards  # type: ignore[attr-defined]
            try:
                made: type = dataclasses.dataclass(cls, **arguments)
            finally:
                dataclasses._frozen_get_del_attr = _generated_guards  # type: ignore[attr-defined]
                _class_being_made.pop()
    else:
        made = dataclasses.dataclass(cls, **arguments)
    if shares_repr or shares_eq:
        params = made.__dataclass_params__  # type: ignore[attr-defined]
        params.repr, params.eq = options.get("repr", True), options.get("eq", True)  # as asked
        fields = dataclasses.fields(made)
        if shares_repr:
            made.__repr__ = _repr_of(made, [f.name for f in fields if f.repr])  # type: ignore[assignment]
        if shares_eq:
            compared = [f.name for f in fields if f.compare]
            hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
            made.__eq__, made.__hash__ = _eq_and_hash_of(made, compared, hashed)  # type: ignore[assignment,method-assign]
    return made


if TYPE_CHECKING:
    from dataclasses import dataclass as record
else:

    def record(cls=None, /, **options):
        """`dataclasses.dataclass(cls, **options)`, a frozen class's methods made without
        compiling (the module's docstring)."""
        if cls is None:
            return lambda cls: _record(cls, options)
        return _record(cls, options)
