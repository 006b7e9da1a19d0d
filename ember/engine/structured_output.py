"""Grammar-constrained decoding with llguidance: every sampled token keeps the output valid.

Frontend side (this module; no torch, the API process imports it):
`json_schema_grammar(schema)` turns a JSON schema into an llguidance grammar for compact
JSON (no whitespace between tokens, at any depth: a model left free to emit it may never
close the object) with its objects closed (`json_schema`), and checks it: a schema
llguidance cannot enforce is a ValueError naming the parameter. Core side:
`ember.engine.grammar_masks` (the matchers and the logits masks).
"""

from __future__ import annotations

import json

from ember.engine.json_schema import check_strict, close_objects

try:
    import llguidance
except ImportError:  # pragma: no cover - llguidance is a pinned dependency
    llguidance = None

# Compact JSON at every depth: a model free to emit whitespace between tokens may never
# close the object (small models do exactly that). Options apply after the schema's own
# "x-guidance", which json_schema_grammar refuses anyway.
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(
    schema: dict | None, param: str = "response_format", strict: bool = False
) -> str:
    """An llguidance grammar for compact JSON values matching `schema` (None: any JSON
    object), its objects closed (`prepare_schema`). ValueError names `param`."""
    if schema is None:
        return _compile({"type": "object"}, param)
    return _compile(prepare_schema(schema, param, strict), param)


def prepare_schema(schema: dict, param: str, strict: bool = False) -> dict:
    """The schema as ember constrains outputs to it: objects closed unless they set
    additionalProperties; with `strict`, first checked against OpenAI's strict rules."""
    if llguidance is None:
        raise ValueError(f"{param}: structured outputs need the llguidance package")
    if "x-guidance" in schema:
        raise ValueError(f"{param}: x-guidance is not supported (ember sets the JSON options)")
    try:
        if strict:
            check_strict(schema)
        return close_objects(schema)
    except ValueError as exc:
        raise ValueError(f"{param}: {exc}") from None


def tool_calls_grammar(functions: list[tuple[str, dict, str]], max_calls: int | None = None) -> str:
    """A grammar for a JSON array of one or more `{"name": ..., "arguments": ...}` calls
    (just one with `max_calls` 1), each one's arguments matching its function's schema.
    `functions`: (name, schema from `prepare_schema`, the parameter that schema came from,
    named in errors)."""
    if max_calls not in (None, 1):
        raise ValueError(f"max_calls must be None or 1, got {max_calls}")
    names = " | ".join(f"call_{i}" for i in range(len(functions)))
    more = "" if max_calls == 1 else ' ("," call)*'
    rules = [f'start: "[" call{more} "]"', f"call: {names}"]
    for i, (name, schema, _) in enumerate(functions):
        rules += [
            f'call_{i}: "{{\\"name\\":" name_{i} ",\\"arguments\\":" arguments_{i} "}}"',
            f"name_{i}: %json {json.dumps(_compact({'const': name}))}",
            f"arguments_{i}: %json {json.dumps(_compact(schema))}",
        ]
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        for _, schema, param in functions:  # the function whose schema failed, by name
            _compile(schema, param)
        raise ValueError(f"tools: unsupported JSON schema: {messages[0]}")
    return grammar


def _compact(schema: dict) -> dict:
    """A schema for lark's %json, with ember's JSON options in it."""
    return dict(schema, **{"x-guidance": _JSON_OPTIONS})


def _compile(schema: dict, param: str) -> str:
    if llguidance is None:
        raise ValueError(f"{param}: structured outputs need the llguidance package")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=_JSON_OPTIONS
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{param}: invalid JSON schema: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{param}: unsupported JSON schema: {messages[0]}")
    return grammar
