"""A corpus of JSON schemas for structured-output tests and the backend benchmark.

`SCHEMAS` is a list of (name, schema). `EXAMPLES[name]` is (valid, invalid): one instance
that conforms and one that breaks exactly the feature the schema exercises, so a test can
check that a grammar both admits the first and refuses the second (a backend that ignores a
keyword admits both). Valid instances list object keys in the schema's declared order, since
grammar backends generate properties in that order.
"""
from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_PERSON: Schema = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

_CORPUS: list[tuple[str, Schema, Any, Any]] = [
    # --- objects --------------------------------------------------------------------------
    ("flat_object", _PERSON, {"name": "Ada", "age": 36}, {"name": "Ada"}),
    ("optional_properties", {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "nickname": {"type": "string"}, "active": {"type": "boolean"}},
        "required": ["id"],
        "additionalProperties": False,
    }, {"id": 7, "active": True}, {"nickname": "x", "active": True}),
    ("additional_properties_false", {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }, {"a": 1}, {"a": 1, "b": 2}),
    ("nested_object", {
        "type": "object",
        "properties": {
            "user": _PERSON,
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"],
                "additionalProperties": False,
            },
        },
        "required": ["user", "address"],
        "additionalProperties": False,
    }, {"user": {"name": "Bo", "age": 3}, "address": {"street": "Main St", "city": "Oslo"}},
        {"user": {"name": "Bo", "age": 3}, "address": {"street": "Main St"}}),
    ("deep_nesting", {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "object", "properties": {"d": {"type": "integer"}}, "required": ["d"],
                  "additionalProperties": False}}, "required": ["c"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}},
        "required": ["a"],
        "additionalProperties": False,
    }, {"a": {"b": {"c": {"d": 1}}}}, {"a": {"b": {"c": {"d": "1"}}}}),
    ("map_of_integers", {
        "type": "object",
        "additionalProperties": {"type": "integer"},
    }, {"x": 1, "y": 2}, {"x": "one"}),
    ("open_object", {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "additionalProperties": True,
    }, {"kind": "k", "extra": [1, {"z": None}]}, {"extra": 1}),
    ("min_max_properties", {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "minProperties": 1,
        "maxProperties": 2,
    }, {"a": "x"}, {}),
    ("pattern_properties", {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    }, {"x_a": 1}, {"y": 1}),
    ("property_names", {
        "type": "object",
        "propertyNames": {"pattern": "^[a-z]+$"},
        "additionalProperties": {"type": "integer"},
    }, {"abc": 1}, {"ABC": 1}),
    ("dependent_required", {
        "type": "object",
        "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
        "dependentRequired": {"card": ["billing"]},
        "additionalProperties": False,
    }, {"card": "4111", "billing": "Oslo"}, {"card": "4111"}),
    # --- arrays ---------------------------------------------------------------------------
    ("array_of_strings", {"type": "array", "items": {"type": "string"}}, ["a", "b"], ["a", 1]),
    ("array_min_max_items", {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4,
    }, [1, 2, 3], [1]),
    ("array_max_items", {
        "type": "array", "items": {"type": "integer"}, "maxItems": 2,
    }, [1, 2], [1, 2, 3]),
    ("array_exact_length", {
        "type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3,
    }, [1.5, 2, 3], [1.5, 2]),
    ("array_of_objects", {
        "type": "array",
        "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                  "required": ["sku", "qty"], "additionalProperties": False},
        "minItems": 1,
    }, [{"sku": "A1", "qty": 2}], [{"sku": "A1"}]),
    ("nested_arrays", {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    }, [[1, 2], [3, 4]], [[1, 2, 3]]),
    ("tuple_prefix_items", {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}],
        "items": False,
    }, ["x", 1], [1, "x"]),
    ("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("contains", {
        "type": "array", "items": {"type": "integer"}, "contains": {"const": 7},
    }, [1, 7], [1, 2]),
    # --- enum / const ---------------------------------------------------------------------
    ("enum_strings", {"type": "string", "enum": ["red", "green", "blue"]}, "green", "purple"),
    ("enum_mixed", {"enum": ["a", 1, None, True]}, None, False),
    ("enum_in_object", {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed"]}, "priority": {"enum": [1, 2, 3]}},
        "required": ["status", "priority"],
        "additionalProperties": False,
    }, {"status": "open", "priority": 2}, {"status": "open", "priority": 4}),
    ("const_string", {
        "type": "object", "properties": {"version": {"const": "v1"}}, "required": ["version"],
        "additionalProperties": False,
    }, {"version": "v1"}, {"version": "v2"}),
    ("const_object", {"const": {"k": [1, 2]}}, {"k": [1, 2]}, {"k": [1]}),
    # --- composition ----------------------------------------------------------------------
    ("any_of_primitives", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "seven", 7.5),
    ("one_of_objects", {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
             "required": ["kind", "side"], "additionalProperties": False},
        ],
    }, {"kind": "square", "side": 2}, {"kind": "circle", "side": 2}),
    ("all_of_merge", {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ],
    }, {"a": 1, "b": "x"}, {"a": 1}),
    ("nullable_type_list", {
        "type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"],
        "additionalProperties": False,
    }, {"note": None}, {"note": 3}),
    ("if_then_else", {
        "type": "object",
        "properties": {"country": {"type": "string"}, "zip": {"type": "string"}},
        "required": ["country", "zip"],
        "if": {"properties": {"country": {"const": "US"}}},
        "then": {"properties": {"zip": {"pattern": "^[0-9]{5}$"}}},
        "additionalProperties": False,
    }, {"country": "US", "zip": "12345"}, {"country": "US", "zip": "abc"}),
    ("not_keyword", {"type": "integer", "not": {"const": 0}}, 3, 0),
    # --- $ref / $defs ---------------------------------------------------------------------
    ("ref_defs", {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}},
        "required": ["home", "work"],
        "additionalProperties": False,
        "$defs": {"addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}},
    }, {"home": {"city": "A"}, "work": {"city": "B"}}, {"home": {"city": "A"}, "work": {}}),
    ("ref_definitions_draft7", {
        "type": "array",
        "items": {"$ref": "#/definitions/point"},
        "definitions": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                  "required": ["x", "y"], "additionalProperties": False}},
    }, [{"x": 1, "y": 2}], [{"x": 1}]),
    ("ref_recursive_tree", {
        "$ref": "#/$defs/node",
        "$defs": {"node": {
            "type": "object",
            "properties": {"value": {"type": "integer"},
                           "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["value"],
            "additionalProperties": False,
        }},
    }, {"value": 1, "children": [{"value": 2, "children": []}]}, {"value": 1, "children": [{"children": []}]}),
    # --- strings --------------------------------------------------------------------------
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "ABC-123", "AB-123"),
    ("string_min_max_length", {"type": "string", "minLength": 2, "maxLength": 5}, "abc", "abcdef"),
    ("string_min_length", {"type": "string", "minLength": 3}, "abc", "ab"),
    ("format_date", {"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    ("format_date_time", {"type": "string", "format": "date-time"}, "2024-02-29T10:00:00Z", "10 o'clock"),
    ("format_email", {"type": "string", "format": "email"}, "ada@example.com", "not an email"),
    ("format_uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "1234"),
    # --- numbers and scalars --------------------------------------------------------------
    ("integer_min_max", {"type": "integer", "minimum": 1, "maximum": 100}, 42, 101),
    ("integer_negative_range", {"type": "integer", "minimum": -10, "maximum": -1}, -5, 0),
    ("number_exclusive_bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5, 1),
    ("integer_multiple_of", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("boolean", {"type": "boolean"}, True, "true"),
    ("null", {"type": "null"}, None, 0),
    ("any_json", {}, {"anything": [1, "two", None]}, None),  # every JSON value is valid: no invalid one
    # --- realistic ------------------------------------------------------------------------
    ("tool_call", {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search"]},
            "arguments": {"type": "object", "properties": {
                "location": {"type": "string", "minLength": 1},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["location"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }, {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
        {"name": "get_weather", "arguments": {"unit": "celsius"}}),
    ("product_catalog", {
        "type": "object",
        "properties": {
            "products": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^P[0-9]+$"},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["id", "price", "in_stock"],
                "additionalProperties": False,
            }},
            "currency": {"const": "EUR"},
        },
        "required": ["products", "currency"],
        "additionalProperties": False,
    }, {"products": [{"id": "P1", "price": 9.5, "tags": ["new"], "in_stock": True}], "currency": "EUR"},
        {"products": [{"id": "X1", "price": 9.5, "in_stock": True}], "currency": "EUR"}),
    ("event_with_formats", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "start": {"type": "string", "format": "date-time"},
            "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
        },
        "required": ["title", "start", "attendees"],
        "additionalProperties": False,
    }, {"title": "Sync", "start": "2024-05-01T09:30:00Z", "attendees": ["a@b.io"]},
        {"title": "Sync", "start": "2024-05-01T09:30:00Z", "attendees": []}),
]

SCHEMAS: list[tuple[str, Schema]] = [(name, schema) for name, schema, _, _ in _CORPUS]
EXAMPLES: dict[str, tuple[Any, Any]] = {name: (valid, invalid) for name, _, valid, invalid in _CORPUS}
# Schemas whose every JSON value is valid: they have no instance a grammar should refuse.
UNREFUSABLE = frozenset({"any_json"})
