"""The metaschema a JSON schema is checked against before it is normalized (`schema_error`, for
response formats and tools' parameters alike), in a form that checks the same thing faster.

Draft 2020-12's metaschema (the default where a schema names no `$schema`) is seven vocabulary
metaschemas joined by `allOf`, each reaching its subschemas through `$dynamicRef: "#meta"`;
jsonschema resolves every one of those dynamically, by URI, at every subschema, which made the
check about a fifth of `to_constraint`'s time on MaskBench schemas (168 ms of ~760 for 120 on
the 2-core VM). Their properties and `$defs` have distinct names, so merged into one schema
with plain `$ref: "#"` they accept and refuse the same schemas, at the same paths, with the same
messages (tests/schema/test_metaschema.py compares both over MaskBench); about 5x faster.
Other drafts keep their own metaschema. `validator_class` picks a schema's draft, refusing a
`$schema` that is not text (jsonschema's lookup raises AttributeError on it).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import jsonschema
from jsonschema_specifications import REGISTRY

from structgen.errors import InvalidConstraintError

_DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/"


def validator_class(schema: dict[str, Any]) -> Any:
    """The jsonschema validator class of the draft `schema`'s `$schema` names (2020-12 where it
    names none, or one jsonschema does not know). A `$schema` that is not text is refused here:
    jsonschema's lookup would fail on it with an AttributeError."""
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        raise InvalidConstraintError(
            f"$schema must be the URI of a JSON Schema draft, as a string; got {declared!r:.60}")
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def schema_error(schema: dict[str, Any]) -> tuple[str, str] | None:
    """What the metaschema of `schema`'s draft finds wrong with it, as (where, message) of the
    best-matching error; None where nothing is. One rule is waived: an `enum` listing a value
    twice (draft 4 forbids it, later drafts only advise against it; it changes nothing, MaskBench
    Github_ultra 3). Formats are not asserted: patterns are checked by `python_patterns`, which
    tells a pattern Python's `re` cannot read from an invalid schema. Raises
    InvalidConstraintError for a `$schema` that is not text."""
    cls = validator_class(schema)
    errors = [
        e for e in cls(metaschema(cls)).iter_errors(schema)
        if not (e.validator == "uniqueItems" and e.path and e.path[-1] == "enum")
    ]  # fmt: skip
    error = jsonschema.exceptions.best_match(errors)
    if error is None:
        return None
    return ("#/" + "/".join(map(str, error.path)) if error.path else "#"), error.message


def metaschema(validator_cls: Any) -> dict[str, Any]:
    """The metaschema to check a schema of `validator_cls`'s draft against."""
    if validator_cls is jsonschema.Draft202012Validator:
        return _flat_2020_12() or validator_cls.META_SCHEMA
    return validator_cls.META_SCHEMA


@functools.cache
def _flat_2020_12() -> dict[str, Any] | None:
    """The merged metaschema, or None where the installed metaschemas are not shaped as this
    expects (a later jsonschema-specifications): then the original one, only slower."""
    try:
        return _merged_2020_12()
    except (ValueError, KeyError, TypeError):
        return None


def _merged_2020_12() -> dict[str, Any]:
    root = jsonschema.Draft202012Validator.META_SCHEMA
    flat: dict[str, Any] = {"$schema": root["$schema"], "type": ["object", "boolean"], "properties": {}, "$defs": {}}
    parts = [REGISTRY.contents(_DRAFT_2020_12 + part["$ref"]) for part in root["allOf"]]
    for part in [*parts, root]:
        for key in ("properties", "$defs"):
            for name, value in part.get(key, {}).items():
                if name in flat[key]:
                    raise ValueError(f"{key} {name!r} defined twice")
                flat[key][name] = _local(copy.deepcopy(value))
    return flat


def _local(node: Any) -> Any:
    """`node` with the dynamic references to the whole metaschema made `#`, and references into
    a vocabulary's `$defs` made local (the merged `$defs` hold them all)."""
    if isinstance(node, list):
        return [_local(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _local(v) for k, v in node.items()}
    if out.get("$dynamicRef") == "#meta":
        del out["$dynamicRef"]
        out["$ref"] = "#"
    ref = out.get("$ref")
    if isinstance(ref, str) and ref != "#":
        _, _, pointer = ref.partition("#")
        if not pointer.startswith("/$defs/"):
            raise ValueError(f"unexpected $ref {ref!r}")
        out["$ref"] = "#" + pointer
    return out
