"""Chat templates: rendering one in Jinja's sandbox, within a budget, and checking one.

A chat template is code that came with a model (a tokenizer_config.json, a GGUF file's
metadata) or from `--chat-template`: it is untrusted. Jinja's immutable sandbox keeps it
away from files and Python internals; this module adds what the sandbox does not bound:
- output: rendering stops once the text passes `max_chars` (more than the context could
  hold);
- what one expression can allocate: `*` and `**` are checked before they run, so
  `'a' * 1500000000` or `10 ** 10 ** 9` fail instead of eating memory or a core.
Time (a template that loops) and memory allocated some other way are bounded by running
the render somewhere that can be stopped: `actors/template_renderer.py` renders in a
child process with a deadline and an address-space limit, and kills it past either.

The environment is the one transformers renders with (trim_blocks, lstrip_blocks, the
loopcontrols extension, a `{% generation %}` tag, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`, `namespace`, `dict`), so outputs are identical to
`apply_chat_template(..., tokenize=False)`; tests/engine/test_chat_template.py checks it.

Every failure raises `ChatTemplateError` (a ValueError): the request gets a 400 naming
the template, and no other request notices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OPERAND = 1 << 20  # the most elements (or characters) one `*` may produce
MAX_POWER_BITS = 4096  # the most bits one `**` may produce


class ChatTemplateError(ValueError):
    """A chat template could not render these messages: it refused them
    (`raise_exception`), failed, or went over its time, memory or output budget. The
    message names the template and says which."""


class TemplateBudgetError(ChatTemplateError):
    """A render went over its budget (time, memory, output, recursion): the process that
    ran it is best replaced."""


@dataclass(frozen=True)
class TemplateBudget:
    """What one render may take: `deadline_s` of wall time and `memory_bytes` of address
    space (both enforced where the render runs in a child process), and `max_chars` of
    output (enforced everywhere)."""

    deadline_s: float = 1.0
    memory_bytes: int = 512 << 20
    max_chars: int = 16 << 20


@dataclass(frozen=True)
class ChatTemplate:
    """A template's Jinja source, a name for it in errors (never a path), and the
    variables it sees beside `messages` and `add_generation_prompt` (the tokenizer's
    special tokens: `bos_token`, `eos_token`, ...)."""

    source: str
    name: str
    variables: dict[str, Any] = field(default_factory=dict)


class ChatRenderer(Protocol):
    """Turns messages into a template's text; raises ChatTemplateError otherwise.
    `variables`: more template variables for this render (`tools`, a request's
    `chat_template_kwargs`), over the template's own."""

    def render(
        self, messages: list[dict], add_generation_prompt: bool, variables: dict | None = None
    ) -> str: ...


# A few conversations every chat template should render (one of them, at least).
SAMPLE_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hello!"},),
    (
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
    ),
    (
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a story."},
    ),
)


def render(
    template: ChatTemplate,
    messages: list[dict],
    add_generation_prompt: bool,
    max_chars: int = TemplateBudget.max_chars,
    variables: dict | None = None,
) -> str:
    """The template's text for `messages`; ChatTemplateError naming the template when it
    refuses them, fails, or passes `max_chars` characters of output. `variables` (the
    request's `tools`, its template kwargs) are set over the template's own."""
    try:
        compiled = _compile(template.source)
        context = {
            **template.variables,
            "tools": None,
            "documents": None,
            **(variables or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return _bounded_join(compiled.generate(**context), max_chars, template.name)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:  # e.g. the template's own raise_exception()
        raise ChatTemplateError(f"{template.name}: {exc}") from None
    except MemoryError:
        raise TemplateBudgetError(f"{template.name} ran out of memory rendering") from None
    except RecursionError:
        raise TemplateBudgetError(f"{template.name} recursed too deeply rendering") from None
    except Exception as exc:  # noqa: BLE001 - the template's own failure, this request's
        raise ChatTemplateError(
            f"{template.name} failed rendering: {type(exc).__name__}: {exc}"
        ) from None


def check_template(renderer: ChatRenderer, name: str) -> None:
    """Raises ChatTemplateError (naming the template and each sample's error) unless the
    renderer renders at least one of SAMPLE_CONVERSATIONS: a template that fails on
    every conversation is broken, and is better refused at start-up than at the first
    chat. A template may refuse some samples (e.g. a system turn) on purpose."""
    errors = []
    for conversation in SAMPLE_CONVERSATIONS:
        try:
            renderer.render([dict(m) for m in conversation], add_generation_prompt=True)
            return
        except ChatTemplateError as exc:
            errors.append(str(exc))
    raise ChatTemplateError(
        f"{name} renders none of {len(SAMPLE_CONVERSATIONS)} sample conversations "
        f"({'; '.join(dict.fromkeys(errors))}); fix it or pass --chat-template"
    )


class InlineRenderer:
    """Renders in the calling thread: bounded in output and per expression, not in time
    (the offline `LLM`, whose templates are its user's own; tests)."""

    def __init__(self, template: ChatTemplate, budget: TemplateBudget | None = None) -> None:
        self.template = template
        self.budget = budget or TemplateBudget()

    def render(
        self, messages: list[dict], add_generation_prompt: bool, variables: dict | None = None
    ) -> str:
        max_chars = self.budget.max_chars
        return render(self.template, messages, add_generation_prompt, max_chars, variables)


def _bounded_join(chunks: Iterable[str], max_chars: int, name: str) -> str:
    out, total = [], 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_chars:
            raise TemplateBudgetError(
                f"{name} rendered more than {max_chars:,} characters (more than the "
                "context can hold)"
            )
        out.append(chunk)
    return "".join(out)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers uses the
    tag to find assistant tokens; rendering text needs only the body)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` without underscore attributes (as transformers allows)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """`dict(...)` for templates, without the type's other attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` checked for the size of what they make."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
        elif op == "**":
            _check_power(left, right)
        return super().call_binop(context, op, left, right)


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
        if len(seq) * max(times, 0) > MAX_OPERAND:
            raise jinja2.exceptions.SecurityError(
                f"a repetition would make {len(seq) * times:,} items (at most {MAX_OPERAND:,})"
            )


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if abs(base).bit_length() * exponent > MAX_POWER_BITS:
            raise jinja2.exceptions.SecurityError(
                f"a power would have about {abs(base).bit_length() * exponent:,} bits "
                f"(at most {MAX_POWER_BITS:,})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env.from_string(source)
