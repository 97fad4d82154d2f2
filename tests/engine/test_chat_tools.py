"""Tool turns and template kwargs reach the chat template as transformers passes them:
`tools=` and extra variables beside the messages, assistant `tool_calls` with their
arguments parsed, `tool` turns with the call they answer; the same text either way,
through the wire messages and the text processor too."""

from __future__ import annotations

import json

import pytest

from engine.codec import InboxDecoder, encode
from engine.messages import ChatPrompt, ChatTemplateArgs, GenerateRequest
from engine.sampling_params import SamplingParams
from engine.text.chat_template import render
from engine.text.request_validation import RequestLimits
from engine.text.text_processor import TextProcessor
from engine.text.tokenizer import Tokenizer
from tests.engine.test_tokenizer import tiny_hf_tokenizer

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(temperature=0, max_tokens=4)

# Qwen 2.5's way with tools, cut to its bones: tools in the system turn, calls and
# responses in tags, an optional empty think block (Qwen3's enable_thinking).
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>tools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>{{ message.content }}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}\n"
    "{%- elif message.role == 'tool' %}<|user|><tool_response>\n{{ message.content }}"
    "\n</tool_response>\n"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{%- endif %}"
    "{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_7",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'},
}
CONVERSATION = [
    {"role": "user", "content": "weather in paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_7"},
]


def as_transformers_takes_it(messages: list[dict]) -> list[dict]:
    """transformers' templates read call arguments as objects, not JSON text."""
    out = []
    for m in messages:
        m = dict(m, content=m.get("content") or "")
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def ours(chat: ChatPrompt, add_generation_prompt: bool = True) -> str:
    tok = Tokenizer(tiny_hf_tokenizer(HERMES_TEMPLATE))
    dicts, variables = chat.template_inputs()
    return render(tok.chat_template, dicts, add_generation_prompt, variables=variables)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_tools_and_tool_turns_render_as_transformers_renders(kwargs) -> None:
    hf = tiny_hf_tokenizer(HERMES_TEMPLATE)
    want = hf.apply_chat_template(
        as_transformers_takes_it(CONVERSATION),
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
        **kwargs,
    )
    got = ours(ChatPrompt.of(CONVERSATION, tools=TOOLS, chat_template_kwargs=kwargs or None))
    assert got == want
    assert '"arguments": {"city": "Paris", "unit": "°C"}' in got  # parsed, then tojson
    assert "<tool_response>\nsunny" in got and '"name": "get_weather"' in got


def test_without_tools_the_template_sees_none() -> None:
    chat = ChatPrompt.of([{"role": "user", "content": "hi"}])
    assert chat.template_args is None
    assert "tools:" not in ours(chat)


def test_arguments_that_are_not_a_json_object_reach_the_template_as_text() -> None:
    odd = dict(CALL, function={"name": "f", "arguments": "not json"})
    [_, assistant, _] = ChatPrompt.of(
        [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [odd]}, CONVERSATION[2]]
    ).messages
    assert assistant.template_dict()["tool_calls"][0]["function"]["arguments"] == "not json"


def test_a_chat_prompt_travels_the_wire_whole() -> None:
    chat = ChatPrompt.of(CONVERSATION, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    request = GenerateRequest.of("r1", "c1", chat, SamplingParams())
    decoded = InboxDecoder([GenerateRequest]).decode(encode(request))
    assert decoded == request
    assert decoded.template_args == chat.template_args
    assert decoded.messages[1].tool_calls[0].arguments == CALL["function"]["arguments"]
    assert decoded.messages[2].tool_call_id == "call_7"


def test_template_args_give_tools_and_kwargs_as_variables() -> None:
    args = ChatTemplateArgs(json.dumps(TOOLS), json.dumps({"enable_thinking": False}))
    assert args.variables() == {"tools": TOOLS, "enable_thinking": False}
    assert ChatTemplateArgs().variables() == {}


def test_the_text_processor_renders_a_requests_tools_and_counts_them() -> None:
    tok = Tokenizer(tiny_hf_tokenizer(HERMES_TEMPLATE))
    processor = TextProcessor(tok, RequestLimits(tok.vocab_size, 4096))
    with_tools = GenerateRequest.of("r1", "c1", ChatPrompt.of(CONVERSATION, tools=TOOLS), GREEDY)
    without = GenerateRequest.of("r2", "c1", CONVERSATION, GREEDY)
    rendered = processor.render(with_tools)
    assert rendered == ours(ChatPrompt.of(CONVERSATION, tools=TOOLS))
    assert "tools:" in rendered and "tools:" not in processor.render(without)
    assert len(processor.prepare(with_tools, rendered)) > len(processor.prepare(without))
