"""`memtop.base.records.record`: memtop's frozen records made without compiling their repr,
equality, hash and guards (issue 35 item 8, the dashboard's start), and each of those methods
doing exactly what `dataclasses.dataclass`'s generated one does, for every record memtop has."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import pkgutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import memtop
import memtop.base.records as records
from memtop.base.records import record

PACKAGE = Path(memtop.__file__).parent


def modules_with_records() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(PACKAGE)], "memtop."):
        path = PACKAGE.joinpath(*info.name.split(".")[1:])
        source = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        if source.is_file() and "@record(" in source.read_text():
            names.append(info.name)
    return names


MODULES = modules_with_records()


def copy_made_by(name: str, maker: Any, quickly: bool) -> types.ModuleType:
    """The module's source run again with `record` as `maker`, quickly or not (in-process, the
    suite's own memtop modules were made as a trainer makes them: dataclasses' own)."""
    module = importlib.import_module(name)
    copy = types.ModuleType(f"{name}_made_by_{maker.__name__}_{quickly}")
    copy.__file__ = module.__file__
    source = Path(module.__file__ or "").read_text()
    real_record, real_quickly = records.record, records._quickly
    records.record, records._quickly = maker, quickly
    sys.modules[copy.__name__] = copy
    try:
        exec(compile(source, str(module.__file__), "exec"), copy.__dict__)
    finally:
        records.record, records._quickly = real_record, real_quickly
    return copy


def record_pairs(name: str) -> Iterator[tuple[type, type]]:
    """Each frozen record of the module as the viewer makes it, beside the class dataclasses
    makes of the same source."""
    made_quickly = copy_made_by(name, record, quickly=records._COMPILES_EACH_METHOD)
    reference = copy_made_by(name, dataclasses.dataclass, quickly=False)
    for attribute, made in vars(made_quickly).items():
        if (
            isinstance(made, type)
            and dataclasses.is_dataclass(made)
            and made.__module__ == made_quickly.__name__
            and made.__dataclass_params__.frozen  # type: ignore[attr-defined]
        ):
            yield made, getattr(reference, attribute)


@pytest.fixture(autouse=True)
def quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`record` as the viewer has it (memtop/__main__.py asks for it), for this module's tests."""
    monkeypatch.setattr(records, "_quickly", records._COMPILES_EACH_METHOD)


def bare(cls: type, values: dict[str, Any]) -> Any:
    """An instance with these field values, not through __init__ (whose checks are not what is
    compared here)."""
    instance: Any = object.__new__(cls)
    for field, value in values.items():
        object.__setattr__(instance, field, value)
    return instance


def outcome(call: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "returned", call(*args)
    except Exception as error:
        return type(error).__name__, str(error)


@pytest.mark.parametrize("name", MODULES)
def test_every_record_behaves_as_the_dataclass_made_of_the_same_class(name: str) -> None:
    pairs = list(record_pairs(name))
    assert pairs, name
    for made, reference in pairs:
        where = f"{name}.{made.__qualname__}"
        assert [f.name for f in dataclasses.fields(made)] == [
            f.name for f in dataclasses.fields(reference)
        ], where
        assert repr(made.__dataclass_params__) == repr(reference.__dataclass_params__), where  # type: ignore[attr-defined]
        assert getattr(made, "__match_args__", None) == getattr(
            reference, "__match_args__", None
        ), where
        assert getattr(made, "__slots__", None) == getattr(reference, "__slots__", None), where
        assert ("__hash__" in vars(made)) == ("__hash__" in vars(reference)), where
        names = [f.name for f in dataclasses.fields(made)]
        values = {field: (i, f"v{i}") for i, field in enumerate(names)}
        one, ref = bare(made, values), bare(reference, values)
        assert repr(one) == repr(ref), where
        assert outcome(hash, one) == outcome(hash, ref), where
        same, ref_same = bare(made, dict(values)), bare(reference, dict(values))
        assert (one == same) == (ref == ref_same) is True, where
        assert one.__eq__(ref) is ref.__eq__(one) is NotImplemented, where
        for field in names:  # each field apart: compared or not, as the class says
            other = {**values, field: ("another",)}
            assert (one == bare(made, other)) == (ref == bare(reference, other)), (where, field)
            hashes = outcome(hash, bare(made, other)), outcome(hash, one)
            reference_hashes = outcome(hash, bare(reference, other)), outcome(hash, ref)
            assert (hashes[0] == hashes[1]) == (reference_hashes[0] == reference_hashes[1]), (
                where,
                field,
            )
        for attribute in [*names[:1], "not_a_field"]:
            assert outcome(setattr, one, attribute, 1) == outcome(setattr, ref, attribute, 1), (
                where,
                attribute,
            )
            assert outcome(delattr, one, attribute) == outcome(delattr, ref, attribute), (
                where,
                attribute,
            )
        if names:
            assert repr(dataclasses.replace(one, **{names[0]: 5})) == repr(
                dataclasses.replace(ref, **{names[0]: 5})
            ), where
        assert dataclasses.astuple(one) == dataclasses.astuple(ref), where
        assert pickle.loads(pickle.dumps(one)) == one, where


def test_a_records_repr_eq_and_hash_are_those_of_dataclass() -> None:
    @record(frozen=True, slots=True)
    class Pair:
        a: float
        b: list[int] = dataclasses.field(default_factory=list, compare=False, repr=False)
        c: object = None

    @dataclasses.dataclass(frozen=True, slots=True)
    class Reference:
        a: float
        b: list[int] = dataclasses.field(default_factory=list, compare=False, repr=False)
        c: object = None

    nan = float("nan")
    assert Pair(nan) == Pair(nan)  # the fields as one tuple: an identical NaN equals itself
    assert Reference(nan) == Reference(nan)
    assert Pair(1.0) != Pair(2.0) and Pair(1.0, [1]) == Pair(1.0, [2])
    assert hash(Pair(1.0, [1], "x")) == hash(Reference(1.0, [1], "x")) == hash((1.0, "x"))
    assert repr(Pair(1.0, [1])) == repr(Reference(1.0, [1])).replace("Reference", "Pair")
    looped = Pair(1.0, c=[])
    looped.c.append(looped)  # type: ignore[attr-defined]
    assert repr(looped).endswith("c=[...])")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'a'"):
        Pair(1.0).a = 2.0  # type: ignore[misc]
    assert Pair.__match_args__ == ("a", "b", "c")
    assert (Pair(1.0) == 1.0) is False and Pair(1.0).__eq__(1.0) is NotImplemented

    @record(frozen=True)
    class Ordered:  # what record leaves to dataclass: its own __eq__, order
        a: int

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    assert Ordered(1) == Ordered(2) and "<string>" not in Ordered.__eq__.__code__.co_filename


def test_a_records_equality_runs_the_bytecode_dataclass_compiles() -> None:
    # The records are compared and hashed on every round (the table's rows, the caches keyed by
    # records): their __eq__ and __hash__ are dataclasses' code, only not compiled per class.
    @record(frozen=True, slots=True)
    class Mine:
        x: int
        y: str

    @dataclasses.dataclass(frozen=True, slots=True)
    class Theirs:
        x: int
        y: str

    for method in ("__eq__", "__hash__"):
        mine, theirs = getattr(Mine, method).__code__, getattr(Theirs, method).__code__
        assert mine.co_code == theirs.co_code and mine.co_names == theirs.co_names, method
        assert getattr(Mine, method).__globals__ is getattr(Theirs, method).__globals__


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13's dataclasses: one exec a class")
def test_memtops_records_are_made_without_compiling_their_methods() -> None:
    # dataclasses exec'd each generated method alone (~0.1 ms each on a quiet box, the frozen
    # guards ~0.27 ms the pair): ~0.4 ms of each of the ~85 records the dashboard makes before
    # its first frame.  Now a record's __init__ is the one exec it costs.
    code = (
        "import builtins, dataclasses\n"
        "making = []\n"
        "frozen = {}\n"
        "real_exec = builtins.exec\n"
        "def counting(source, *args):\n"
        "    if making and making[-1] in frozen:\n"
        "        frozen[making[-1]] += 1\n"
        "    return real_exec(source, *args)\n"
        "builtins.exec = counting\n"
        "real_process = dataclasses._process_class\n"
        "def process(cls, init, repr, eq, order, unsafe_hash, is_frozen, *rest):\n"
        "    if is_frozen and cls.__module__.startswith('memtop.'):\n"
        "        frozen[cls] = 0\n"
        "    making.append(cls)\n"
        "    try:\n"
        "        return real_process(cls, init, repr, eq, order, unsafe_hash, is_frozen, *rest)\n"
        "    finally:\n"
        "        making.pop()\n"
        "dataclasses._process_class = process\n"
        "import memtop.__main__\n"  # the viewer's entry: asks for its records made quickly
        "import memtop.engine.observation, memtop.ui.view, memtop.model\n"
        "print(len(frozen), sum(frozen.values()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    classes, execs = map(int, result.stdout.split())
    assert classes >= 50, result.stdout
    # One exec a record (its __init__), and one for each field count's __eq__ and __hash__
    # the first time: before, ~5.5 a record (364 for 66).
    assert execs < 1.3 * classes, (classes, execs)


def test_other_classes_get_dataclasses_own_guards_while_a_record_is_made() -> None:
    # record answers dataclasses' guard function for its own class only: any other class (on
    # another thread, say) gets the guards dataclasses compiles.
    @dataclasses.dataclass(frozen=True)
    class Plain:
        a: int

    assert Plain.__setattr__.__code__.co_filename == "<string>"
    assert getattr(dataclasses, "_frozen_get_del_attr", None) is records._generated_guards


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13's dataclasses: one exec a class")
def test_while_a_record_is_made_another_class_gets_dataclasses_guards() -> None:
    # What another thread making a frozen dataclass meanwhile would be answered: the guards
    # dataclasses compiles for it, not the record's closures.
    @record(frozen=True)
    class Mine:
        a: int

    class Other:
        a: int

    fields = list(dataclasses.fields(Mine))
    records._class_being_made.append(Mine)
    try:
        theirs = records._frozen_guards(Other, fields, {})
        ours = records._frozen_guards(Mine, fields, {})
    finally:
        records._class_being_made.pop()
    assert [g.__code__.co_filename for g in theirs] == ["<string>", "<string>"]
    assert [g.__code__.co_filename for g in ours] == [records.__file__] * 2
    assert Mine.__setattr__.__code__.co_filename == records.__file__


def test_a_trainer_that_imports_memtops_records_gets_dataclasses_own_untouched() -> None:
    # The agent's process is the trainer's: memtop's records there are made by dataclasses as
    # Python makes them, and dataclasses' module is never changed, not even for a moment.
    code = (
        "import dataclasses\n"
        "real = dataclasses._frozen_get_del_attr\n"
        "import memtop\n"
        "memtop.start_agent()\n"  # what a trainer does: the agent and the records it imports
        "import memtop.base.records as records\n"
        "from memtop.protocol.framing import Request\n"
        "from memtop.base.alloc_conf import AllocConf\n"
        "print(dataclasses._frozen_get_del_attr is real, records._quickly,\n"
        "      Request.__setattr__.__code__.co_filename,\n"
        "      AllocConf.__eq__.__code__.co_filename)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "False", "<string>", "<string>"], result.stdout
