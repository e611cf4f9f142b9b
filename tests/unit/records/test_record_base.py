"""One rule for every record that crosses a process boundary: frozen, no unknown field, equal by wire
form, and a top-level record's version either spoken or refused with what to do."""

import importlib
import inspect
import pkgutil
from typing import ClassVar, Literal

import numpy as np
import pydantic
import pytest

import megatron_apriel.records as records_pkg
from megatron_apriel.records.base import Record
from megatron_apriel.records.rollouts import RolloutGroup
from megatron_apriel.records.stream import TrainerProgress
from megatron_apriel.records.weights import UpdateResult


def record_modules():
    names = [m.name for m in pkgutil.iter_modules(records_pkg.__path__)]
    return [importlib.import_module(f"megatron_apriel.records.{name}") for name in names]


def test_every_pydantic_model_of_the_records_derives_from_record():
    models = [cls for mod in record_modules() for _, cls in inspect.getmembers(mod, inspect.isclass)
              if issubclass(cls, pydantic.BaseModel) and cls.__module__ == mod.__name__]
    assert len(models) >= 15
    assert [m.__name__ for m in models if not issubclass(m, Record)] == []


def test_every_record_with_a_kind_has_a_version_rule():
    kinds = [cls for mod in record_modules() for _, cls in inspect.getmembers(mod, inspect.isclass)
             if issubclass(cls, Record) and "kind" in cls.model_fields]
    assert {c.__name__ for c in kinds} >= {"RolloutGroup", "Segment", "ActorSnapshot", "TrainerProgress",
                                           "TransferInit", "StagePlan", "UpdateRequest", "UpdateResult"}
    for cls in kinds:
        assert cls.VERSION_FIELD in cls.model_fields, cls.__name__
        assert cls.model_fields[cls.VERSION_FIELD].default == cls.VERSION, cls.__name__


class Toy(Record):
    VERSION_FIELD: ClassVar[str] = "toy_version"
    VERSION: ClassVar[int] = 3
    READS: ClassVar[tuple[int, ...]] = (1,)
    MISMATCH: ClassVar[str] = "upgrade the toy."
    kind: Literal["toy"] = "toy"
    toy_version: int = 3
    x: int = 0


def test_the_version_written_and_the_older_ones_listed_are_read_and_no_other():
    assert Toy().toy_version == 3
    assert Toy(toy_version=1).x == 0
    for bad in (0, 2, 4):
        with pytest.raises(ValueError, match=f"Toy has toy_version {bad}, this code speaks 1, 3; upgrade the toy."):
            Toy(toy_version=bad)


def test_unknown_fields_are_refused_and_records_are_frozen():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        Toy(y=1)
    with pytest.raises(pydantic.ValidationError):
        Toy().x = 2


def test_records_are_equal_by_their_wire_form():
    assert Toy(x=1) == Toy(x=1) and Toy(x=1) != Toy(x=2) and hash(Toy(x=1)) == hash(Toy(x=1))
    from megatron_apriel.records.rollouts import RoutedExperts

    a = RoutedExperts.from_array(np.zeros((2, 1, 1), dtype=np.uint8))
    assert a == RoutedExperts.from_array(np.zeros((2, 1, 1), dtype=np.uint8))
    assert a != RoutedExperts.from_array(np.ones((2, 1, 1), dtype=np.uint8))


@pytest.mark.parametrize("cls, field, other", [
    (TrainerProgress, "stream_version", 2),
    (UpdateResult, "protocol_version", 1),
])
def test_each_family_refuses_a_version_it_does_not_speak(cls, field, other):
    fields = {"step": 0, "filled": 0, "cursor": 0, "version": 0} if cls is TrainerProgress else \
        {"version": 1, "accepted": True}
    assert getattr(cls(**fields), field) == cls.VERSION
    with pytest.raises(ValueError, match=f"has {field} {other}, this code speaks"):
        cls(**fields, **{field: other})


def test_rollout_groups_read_their_older_schemas():
    assert RolloutGroup.READS + (RolloutGroup.VERSION,) == (1, 2, 3, 4, 5)


def test_the_old_import_path_still_gives_the_same_records():
    from megatron_apriel.records import rollouts
    from megatron_apriel.rollout import types

    for name in ("Problem", "RolloutGroup", "Rollout", "TrainSample", "DOMAINS", "Outcome", "VersionSpan"):
        assert getattr(types, name) is getattr(rollouts, name)
