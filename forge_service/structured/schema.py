"""JSON Schema handling around the grammar engine: validity, strict mode, approximation, and
validation of what was generated.

- `check_schema`: a schema that is not itself valid JSON Schema is the client's mistake (400).
- `close_objects`: strict mode (OpenAI's `strict: true`): an object schema without
  `additionalProperties` admits only its declared properties.
- `relax`: what the grammar engine cannot express is approximated, and the changes listed:
  sibling keywords of a `$ref` are dropped (the engine cannot combine them with recursive
  references). The backend's own approximations (`oneOf` as `anyOf`, unknown `format` values
  and keywords such as `uniqueItems`, `dependentRequired`, `not`, `if` ignored) are listed by it.
- `OutputValidator`: the full schema, checked with `jsonschema` after generation, so an
  approximated grammar's misses are logged (and counted), never failed after the fact.
"""
from __future__ import annotations

import copy
import json
import logging
from typing import Any, Callable

import jsonschema

from forge_service.errors import InvalidArgument, excerpt

log = logging.getLogger(__name__)

# Keywords that only annotate: dropping them loses no constraint.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$id", "$schema", "$anchor"})
# Keywords whose values are schemas, lists of schemas, or maps of name -> schema.
_SCHEMA_VALUED = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                  "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema(schema: Any) -> None:
    """Raise InvalidArgument unless `schema` is valid under its metaschema (default 2020-12).

    Formats are not checked: a `pattern` is an ECMA-262 regex, which Python's `re` (the
    metaschema's `regex` format check) may misread; the grammar engine checks patterns itself."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument("a JSON Schema must be a JSON object or a boolean")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except RecursionError as e:
        raise InvalidArgument(f"invalid JSON Schema: {e}") from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        message = error.message  # quotes the offending value, which may be huge
        if len(message) > 300:
            message = f"{message[:300]}… ({len(message)} chars)"
        raise InvalidArgument(f"invalid JSON Schema at {excerpt(where)}: {message}")


def _map_subschemas(schema: dict[str, Any], fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of `schema` with fn(subschema, keyword) applied to every direct subschema."""
    out = dict(schema)
    for key in _SCHEMA_VALUED:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key], key)
        elif key == "items" and isinstance(out.get(key), list):  # draft 4-7 tuple form
            out[key] = [fn(s, key) for s in out[key]]
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(s, key) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(s, key) for name, s in out[key].items()}
    if isinstance(out.get("dependencies"), dict):  # draft 7: a list of names or a schema
        out["dependencies"] = {k: fn(v, "dependencies") if isinstance(v, dict) else v
                               for k, v in out["dependencies"].items()}
    return out


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and "properties" in schema)


def close_objects(schema: Any) -> Any:
    """Strict mode: every object schema without `additionalProperties` (or pattern/unevaluated
    properties) gets `additionalProperties: false`. Members of `allOf` stay open, since closing
    each would reject the properties of the others."""
    def visit(node: Any, keyword: str = "") -> Any:
        if not isinstance(node, dict):
            return node
        out = _map_subschemas(node, visit)
        open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
        if keyword != "allOf" and _is_object_schema(out) and not any(k in out for k in open_keys):
            out["additionalProperties"] = False
        return out

    return visit(schema)


def relax(schema: Any) -> tuple[Any, list[str]]:
    """`schema` with every `$ref`'s sibling keywords dropped, and a note per dropped constraint."""
    notes: list[str] = []

    def visit(node: Any, keyword: str = "") -> Any:
        if not isinstance(node, dict):
            return node
        if "$ref" in node and len(node) > 1:
            dropped = sorted(k for k in node if k != "$ref" and k not in ANNOTATIONS and k not in _SCHEMA_MAPS)
            if dropped:
                notes.append(f"keywords beside $ref {node['$ref']} ignored: {', '.join(dropped)}")
            kept = {k: v for k, v in node.items() if k == "$ref" or k in _SCHEMA_MAPS}
            return _map_subschemas(kept, visit)
        return _map_subschemas(node, visit)

    return visit(copy.deepcopy(schema)), notes


class OutputValidator:
    """Checks generated JSON against the full schema; `errors` never raises."""

    def __init__(self, schema: Any) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def errors(self, text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return [f"not JSON: {e}"]
        try:
            return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                    for e in self._validator.iter_errors(value)][:5]
        except RecursionError:
            return ["too deeply nested to validate"]

    def check(self, text: str, what: str, request_id: str) -> bool:
        """Log a warning per violation; True when the text validates."""
        errors = self.errors(text)
        for error in errors:
            log.warning("request %s: %s does not match its schema: %s", request_id, what, error)
        return not errors
