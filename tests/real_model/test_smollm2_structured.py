"""The default model under a JSON schema: asked about France for `{"city": string}`, it
returns JSON that validates and names Paris (unconstrained, SmolLM2 wraps JSON in a
markdown fence; the grammar is what makes it parseable)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT = [
    {
        "role": "user",
        "content": 'What is the capital of France? Answer in JSON: {"city": "..."}',
    }
]


def test_a_json_schema_answer_validates_and_names_paris(smollm2_path: Path):
    llm = LLM(str(smollm2_path), seed=0, kv_cache_memory=256 << 20, max_model_len=2048)
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    out = llm.chat([CHAT], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    assert "paris" in value["city"].lower()
