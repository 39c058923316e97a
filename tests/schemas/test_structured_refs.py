"""$ref in a structured-output schema (schemas/structured.py): every reference resolves to a
checked subschema and no chain of references loops on itself, refused before any compile with
the reference's place named (those that resolve compile and are enforced: tests/worker/test_grammar.py)."""

from __future__ import annotations

import pytest

from schemas.messages import StructuredOutputs
from schemas.structured import UnsupportedSchema, check_structured


@pytest.mark.parametrize(
    ("schema", "pointer", "says"),
    [
        ({"type": "array", "items": {"$ref": "#/$defs/missing"}}, "/items/$ref", "points to no subschema"),
        ({"$ref": "#/definitions/a", "$defs": {"a": {"type": "string"}}}, "/$ref", "points to no subschema"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties"}}},
            "/properties/b/$ref",
            "points to no subschema",
        ),  # a map of schemas, no schema itself
        ({"$ref": "#a"}, "/$ref", "only local references"),  # an anchor: nothing resolves it
        ({"$ref": "#"}, "/$ref", "only leads back to itself"),
        ({"$ref": "#", "type": "object"}, "/$ref", "only leads back to itself"),  # the compiler loops on it too
        (
            {
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/a"}},
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            },
            "/properties/x/$ref",
            "only leads back",
        ),
    ],
)
def test_unresolvable_and_self_only_references_are_refused_where_they_are(schema, pointer, says):
    with pytest.raises(UnsupportedSchema) as refused:
        check_structured(StructuredOutputs(json_schema=schema))
    assert refused.value.keyword == "$ref" and refused.value.pointer == pointer
    assert says in str(refused.value)
