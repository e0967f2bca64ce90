"""What the partial-object tracker knows of the output type at each place of the JSON value:
how a finished value there is validated (a pydantic `TypeAdapter` of that place's type), whether
an open string there is shown as text, the shape of each child, and how a container still open
is shown (a model built with only its finished fields, a dataclass, a dict, a list).

Shapes grow lazily as paths are met and are cached per output type, so a type's adapters are
built once per process."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import pydantic

Children = dict[str, Any] | list[Any]

_SEQUENCES = (list, tuple, set, frozenset, Sequence, typing.Sequence)
_MAPPINGS = (dict, Mapping, typing.Mapping)
_WRAPPERS = ("Required", "NotRequired", "ReadOnly")


class Shape:
    """One place of the output. `annotation` None: no Python type (a JSON-schema output or a
    part of one), finished values there are read as plain JSON."""

    def __init__(self, annotation: Any = None, shows_text: bool = True):
        self.annotation = annotation
        self.shows_text = shows_text
        self._children: dict[str | int, Shape] = {}

    @functools.cached_property
    def adapter(self) -> pydantic.TypeAdapter[Any] | None:
        if self.annotation is None:
            return None
        try:
            return pydantic.TypeAdapter(self.annotation)
        except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, NameError, TypeError):
            return None  # a part pydantic cannot validate alone: shown as plain JSON until the whole is

    def read(self, text: str, children: Children | None) -> Any:
        """The value of finished JSON `text` here: validated by this place's type, or (no
        type) the JSON value itself, `children` already being the parsed members of a
        container. Raises pydantic's `ValidationError` or `ValueError` when invalid."""
        if self.adapter is not None:
            return self.adapter.validate_json(text)
        return children if children is not None else json.loads(text)

    def child(self, key: str | int) -> Shape:
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = self._child_shape(key)
        return found

    def _child_shape(self, key: str | int) -> Shape:
        return Shape()

    def build(self, children: Children) -> Any:
        """The container still open, shown with the finished `children` (and the open one)."""
        return children

    def key_of(self, name: str) -> str:
        """The JSON key of a child given by its Python name (models with aliases differ)."""
        return name


class _ModelShape(Shape):
    """A pydantic model: shown as an instance that has only the fields finished so far
    (`model_construct`; `model_fields_set` names them)."""

    def __init__(self, annotation: Any, model: type[pydantic.BaseModel]):
        super().__init__(annotation, shows_text=False)
        self.model = model
        self.names: dict[str, str] = {}  # JSON key -> field name
        for name, info in model.model_fields.items():
            alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
            self.names[alias or name] = name

    def _child_shape(self, key: str | int) -> Shape:
        info = self.model.model_fields.get(self.names.get(str(key), ""))
        if info is None:
            return Shape()
        metadata = list(info.metadata)
        if info.discriminator is not None:
            metadata.append(pydantic.Field(discriminator=info.discriminator))
        return shape_of(Annotated[(info.annotation, *metadata)] if metadata else info.annotation)

    def build(self, children: Children) -> Any:
        assert isinstance(children, dict)
        fields = {self.names.get(k, k): v for k, v in children.items()}
        return self.model.model_construct(_fields_set=set(fields), **fields)

    def key_of(self, name: str) -> str:
        return next((k for k, n in self.names.items() if n == name), name)


class _DataclassShape(Shape):
    """A dataclass: shown as an instance with only the finished fields set."""

    def __init__(self, annotation: Any, cls: type):
        super().__init__(annotation, shows_text=False)
        self.cls = cls
        self.hints = typing.get_type_hints(cls, include_extras=True)

    def _child_shape(self, key: str | int) -> Shape:
        return shape_of(self.hints[key]) if key in self.hints else Shape()

    def build(self, children: Children) -> Any:
        assert isinstance(children, dict)
        instance = object.__new__(self.cls)
        for name, value in children.items():
            object.__setattr__(instance, name, value)  # frozen dataclasses too
        return instance


class _FieldsShape(Shape):
    """A TypedDict (a dict of the finished keys) or a `dict[str, V]` (any key, values V)."""

    def __init__(self, annotation: Any, hints: dict[str, Any] | None, values: Any = None):
        super().__init__(annotation, shows_text=False)
        self.hints, self.values = hints, values

    def _child_shape(self, key: str | int) -> Shape:
        if self.hints is None:
            return shape_of(self.values)
        return shape_of(_unwrap(self.hints[key])) if key in self.hints else Shape()

    def build(self, children: Children) -> Any:
        return dict(children)


class _SequenceShape(Shape):
    """A list, tuple or set: shown as a list of the items finished so far."""

    def __init__(self, annotation: Any, items: tuple[Any, ...]):
        super().__init__(annotation, shows_text=False)
        self.items = items  # one type for every item, or (tuple[A, B]) one per position

    def _child_shape(self, key: str | int) -> Shape:
        if len(self.items) == 1:
            return shape_of(self.items[0])
        return shape_of(self.items[key]) if isinstance(key, int) and key < len(self.items) else Shape()

    def build(self, children: Children) -> Any:
        return list(children)


def root_shape(output_type: Any) -> Shape:
    """The shape of a whole output: typed for Python types, plain JSON for JSON schemas."""
    try:
        return _cached_shape(output_type)
    except TypeError:  # unhashable: a JSON-schema dict, or a type holding one
        return shape_of(output_type)


@functools.lru_cache(maxsize=256)
def _cached_shape(output_type: Any) -> Shape:
    from structgen.types import _portable_typeddicts  # pydantic's TypedDict before 3.12

    return shape_of(_portable_typeddicts(output_type))


def shape_of(annotation: Any) -> Shape:
    """The shape of one annotation (None, a dict or a structgen marker: an untyped place)."""
    if annotation is None or isinstance(annotation, dict) or type(annotation).__module__ == "structgen.types":
        return Shape()
    core = _core(annotation)
    origin = typing.get_origin(core)
    if isinstance(core, type) and issubclass(core, pydantic.RootModel):
        return Shape(annotation, shows_text=False)  # its JSON is its root's: shown as plain JSON
    if isinstance(core, type) and issubclass(core, pydantic.BaseModel):
        return _ModelShape(annotation, core)
    try:
        if dataclasses.is_dataclass(core) and isinstance(core, type):
            return _DataclassShape(annotation, core)
        if typing.is_typeddict(core):
            return _FieldsShape(annotation, typing.get_type_hints(core, include_extras=True))
    except (NameError, TypeError):  # annotations that do not resolve here: fields as plain JSON
        return Shape(annotation, shows_text=False)
    if core in _SEQUENCES or origin in _SEQUENCES:
        args = [a for a in typing.get_args(core) if a is not Ellipsis]
        return _SequenceShape(annotation, tuple(args) or (Any,))
    if core in _MAPPINGS or origin in _MAPPINGS:
        args = typing.get_args(core)
        return _FieldsShape(annotation, None, args[1] if len(args) == 2 else Any)
    shows_text = core is str or core is Any or (_is_union(core) and str in typing.get_args(core))
    if origin is Literal or (isinstance(core, type) and issubclass(core, enum.Enum)):
        shows_text = False  # half an option is no option
    return Shape(annotation, shows_text)


def _core(annotation: Any) -> Any:
    """The type under `Annotated[...]` and `X | None` (a None value is a finished literal)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated or (origin is not None and getattr(origin, "_name", "") in _WRAPPERS):
            annotation = typing.get_args(annotation)[0]
            continue
        if _is_union(annotation):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation


def _unwrap(annotation: Any) -> Any:
    """A TypedDict key's type without `Required`/`NotRequired` (no meaning outside the dict)."""
    origin = typing.get_origin(annotation)
    if origin is not None and getattr(origin, "_name", "") in _WRAPPERS:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def _is_union(annotation: Any) -> bool:
    import types

    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
