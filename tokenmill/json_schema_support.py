"""JSON-schema keywords xgrammar compiles without enforcing: a schema that uses one is refused up
front (``GrammarCache`` asks ``unenforced_json_keyword``), since an output could otherwise finish
"stop" and still break its own schema. vLLM's xgrammar backend refuses such schemas too
(``has_xgrammar_unsupported_json_features``); each keyword here was checked against xgrammar 0.2.9:
its grammar with the keyword equals the one without (for ``contains``, a wrong one)."""

from __future__ import annotations

import functools
import json
from typing import Any

# The string formats xgrammar knows (vLLM's STRING_SUPPORTED_FORMATS); it ignores any other.
_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                      "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Where a schema holds subschemas: maps of them, lists of them, and one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONES = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                "propertyNames", "contains", "not", "if", "then", "else")
# Keywords xgrammar compiles to the grammar it makes without them (or, for contains, a wrong one).
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains", "maxContains")
# What may stand beside a $ref: xgrammar follows the reference and drops every constraint beside it.
_REF_SIBLINGS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
                           "default", "examples", "deprecated", "readOnly", "writeOnly"})


@functools.lru_cache(maxsize=256)  # a job's rows mostly repeat a few schemas
def unenforced_json_keyword(spec: str) -> str | None:
    """Where ``spec`` (a JSON schema) uses a keyword xgrammar compiles without enforcing, so that a
    finished output could break its own schema; None if nowhere. vLLM's xgrammar backend refuses
    these too (has_xgrammar_unsupported_json_features); each was checked against xgrammar 0.2.9:
    its grammar with the keyword equals the one without. Schemas that are no JSON are xgrammar's to refuse."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError:
        return None
    return _check_schema(schema, "#")


def _check_schema(node: Any, path: str) -> str | None:
    if not isinstance(node, dict):
        return None  # true / false, or not a schema (xgrammar says so)
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None  # None: any
    ignored = next((key for key in _IGNORED if key in node), None)
    if node.get("uniqueItems") is True:
        ignored = "uniqueItems"
    elif "multipleOf" in node and not (types == {"integer"} and isinstance(node["multipleOf"], int)):
        ignored = "multipleOf"  # enforced on integers only
    elif isinstance(node.get("format"), str) and node["format"] not in _FORMATS and (types is None or "string" in types):
        ignored = "format"
    elif ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        ignored = "minLength" if "minLength" in node else "maxLength"  # the pattern or format alone is enforced
    elif "propertyNames" in node and ("properties" in node or "patternProperties" in node
                                      or isinstance(node.get("additionalProperties"), dict)):
        ignored = "propertyNames"
    elif isinstance(node.get("patternProperties"), dict) and ("properties" in node or len(node["patternProperties"]) > 1):
        ignored = "patternProperties"
    elif "$ref" in node and (beside := sorted(set(node) - _REF_SIBLINGS)):
        ignored = beside[0]
    if ignored is not None:
        return (f"at {path}, {ignored}={json.dumps(node[ignored])[:100]} is not enforced by xgrammar (outputs could "
                "break it); leave it out or express it with keywords xgrammar supports")
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", False) is not False or "patternProperties" in node
    missing = [name for name in node.get("required") or () if name not in properties] if not extra else []
    if missing:  # objects take no properties the schema does not name: xgrammar drops the requirement
        return (f"at {path}, required={missing!r:.100} names properties this schema's properties does not define "
                "(objects take no others here, and xgrammar would not require them)")
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            if found := _check_schema(sub, f"{path}/{key}/{name}"):
                return found
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node[key]) if isinstance(node.get(key), list) else ():
            if found := _check_schema(sub, f"{path}/{key}/{i}"):
                return found
    for key in _SCHEMA_ONES:
        if found := _check_schema(node.get(key), f"{path}/{key}"):
            return found
    return None
