"""Structured output through the offline engine: the grammar masks the logits, so the text always
parses, and bad constraints are rejected before anything is queued."""

import json
import re

import pytest

from zcode.errors import ValidationError
from zcode.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def _generate(llm, constraint, **params):
    # Bounded lengths and whitespace keep every schema here finishing well within max_tokens.
    params = SamplingParams(max_tokens=96, structured_outputs=constraint, **params)
    return llm.generate("Write something:", params)[0]


@pytest.mark.parametrize("temperature", [0.0, 1.2])
def test_json_schema_output_parses_and_follows_the_schema(default_llm, temperature):
    constraint = StructuredOutputsParams(json=PERSON)
    out = _generate(default_llm, constraint, temperature=temperature, seed=0)
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    assert set(value) == {"name", "tags"} and set(value["tags"]) <= {1, 2}


def test_regex_and_choice(default_llm):
    constraint = StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}")
    out = _generate(default_llm, constraint, temperature=1.0)
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", out.text) and out.finish_reason == "stop"
    out = _generate(default_llm, StructuredOutputsParams(choice=["alpha", "beta"]), temperature=1.0)
    assert out.text in {"alpha", "beta"}


def test_unconstrained_sampling_is_unchanged(default_llm):
    plain = default_llm.generate("Write something:", SamplingParams(max_tokens=8, temperature=0))[0]
    assert not plain.text.lstrip().startswith("{")  # else the json test above proves nothing


def test_bad_constraints_are_rejected_before_queueing(default_llm):
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputsParams(json_object=True, regex="a")
    with pytest.raises(ValidationError, match="invalid structured output"):
        _generate(default_llm, StructuredOutputsParams(json={"type": "objectx"}))
    assert not default_llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "string", "minLength": 5, "maxLength": 2},
    ],
)
def test_schemas_no_text_satisfies_are_rejected(default_llm, schema):
    with pytest.raises(ValidationError, match="invalid structured output"):
        default_llm.engine.grammars.matcher(StructuredOutputsParams(json=schema))
    # a schema that refers to itself through an optional property is fine
    default_llm.engine.grammars.matcher(
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#"}}})
    )


def test_lark_grammar(default_llm):
    constraint = StructuredOutputsParams(grammar='start: ("yes" | "no") "!"')
    out = _generate(default_llm, constraint, temperature=1.0, seed=1)
    assert out.text in {"yes!", "no!"} and out.finish_reason == "stop"
