"""JSON schemas of varied shapes, each bounded (every string, array and number has limits), so a
constrained output must end within a few hundred tokens."""

NAME = {"type": "string", "maxLength": 16}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]},
            "city": NAME,
        },
        "required": ["person", "city"],
    },
    "booleans": {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "urgent": {"type": "boolean"}},
        "required": ["done", "urgent"],
    },
    "optional": {"type": "object", "properties": {"title": NAME, "subtitle": NAME}, "required": ["title"]},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [DIGIT, {"type": "string", "maxLength": 8}]}},
        "required": ["value"],
    },
    "ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    "objects_array": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["item", "qty"],
        },
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "name": NAME},
        "required": ["version", "name"],
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["note"],
    },
    "enum_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
    },
    "variants": {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "r": DIGIT},
                        "required": ["kind", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": DIGIT},
                        "required": ["kind", "side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "pair": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 2},
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": DIGIT}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "closed": {
        "type": "object",
        "properties": {"x": DIGIT, "y": DIGIT, "z": DIGIT},
        "required": ["x", "y", "z"],
        "additionalProperties": False,
    },
    "integer_range": {
        "type": "object",
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
        },
        "required": ["year", "month"],
    },
}
