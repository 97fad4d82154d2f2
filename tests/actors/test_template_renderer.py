"""Chat templates rendered in killable child processes: a render past its deadline or
its memory fails alone and fast, the others go on, no child outlives its renderer."""

from __future__ import annotations

import resource
import threading
import time

import pytest

from actors.template_renderer import IsolatedRenderer, isolate_templates
from engine.messages import ChatPrompt
from engine.text.chat_template import ChatTemplateError, TemplateBudget, render
from engine.text.tokenizer import Tokenizer
from tests.engine.test_chat_template import CHATML, CONVERSATIONS, template
from tests.engine.test_chat_tools import CONVERSATION, HERMES_TEMPLATE, TOOLS
from tests.engine.test_tokenizer import TEMPLATE, tiny_hf_tokenizer

pytestmark = pytest.mark.timeout(60)

# Loops (about forever) only when a message says the trigger word.
TRIGGER = (
    "{% for m in messages %}{% if 'xyzzy' in m.content %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{% endfor %}" + TEMPLATE
)
BOMB = (
    "{% for m in messages %}{% if 'xyzzy' in m.content %}{{ 'a' | center(1500000000) }}"
    "{% endif %}{% endfor %}" + TEMPLATE
)
TRIGGERED = [{"role": "user", "content": "say xyzzy"}]


@pytest.fixture
def renderer():
    made = []

    def make(source: str, budget: TemplateBudget | None = None) -> IsolatedRenderer:
        made.append(IsolatedRenderer(template(source), budget or TemplateBudget(deadline_s=0.5)))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_renders_what_the_inline_renderer_renders(renderer) -> None:
    isolated = renderer(CHATML)
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            want = render(template(CHATML), conversation, prompt)
            assert isolated.render(conversation, prompt) == want


def test_a_renders_tools_and_template_kwargs_reach_the_child(renderer) -> None:
    chat = ChatPrompt.of(CONVERSATION, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    dicts, variables = chat.template_inputs()
    isolated = renderer(HERMES_TEMPLATE)
    want = render(template(HERMES_TEMPLATE), dicts, True, variables=variables)
    assert isolated.render(dicts, True, variables) == want
    assert "tools:" in want and "<think>" in want


def test_a_looping_render_fails_at_its_deadline_and_others_go_on(renderer) -> None:
    isolated = renderer(TRIGGER)
    isolated.warm()
    answered: list[float] = []

    def plain() -> None:
        start = time.monotonic()
        isolated.render(CONVERSATIONS[0], True)
        answered.append(time.monotonic() - start)

    start = time.monotonic()
    thread = threading.Thread(target=plain)
    with pytest.raises(ChatTemplateError, match="took longer than 0.5 s"):
        thread.start()
        isolated.render(TRIGGERED, True)
    took = time.monotonic() - start
    thread.join()
    assert 0.5 <= took < 2.0
    assert answered and answered[0] < 1.0  # not queued behind the looping render
    assert isolated.num_killed == 1
    assert isolated.render(CONVERSATIONS[0], True).startswith("<|user|>")  # a fresh child


def test_a_memory_bomb_fails_in_the_child_and_the_parent_keeps_its_memory(renderer) -> None:
    isolated = renderer(BOMB, TemplateBudget(deadline_s=5.0, memory_bytes=256 << 20))
    isolated.warm()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ChatTemplateError, match="out of memory"):
        isolated.render(TRIGGERED, True)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100 << 10
    assert isolated.render(CONVERSATIONS[0], True)


def test_a_template_that_never_renders_stops_start_up() -> None:
    tok = Tokenizer(tiny_hf_tokenizer("{% include 'other.jinja' %}"))
    with pytest.raises(ChatTemplateError, match="renders none of 3 sample conversations"):
        isolate_templates(tok)


def test_isolating_moves_renders_into_children_and_close_ends_them() -> None:
    tok = Tokenizer(tiny_hf_tokenizer())
    isolated = isolate_templates(tok)
    assert isolated is not None and tok.renderer is isolated
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s><|user|>")
    children = [c.proc for c in isolated._idle]
    assert children and all(p.poll() is None for p in children)
    isolated.close()
    assert all(p.poll() is not None for p in children)
    with pytest.raises(ChatTemplateError, match="shut down"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_no_template_no_renderer() -> None:
    assert isolate_templates(None) is None
    assert isolate_templates(Tokenizer(tiny_hf_tokenizer(None))) is None
