"""docs/openai_fields.md, rendered from the routes' field tables:
`python -m web.openai_fields_doc > docs/openai_fields.md` (a test keeps the two equal)."""

from __future__ import annotations

from web.openai_fields import CHAT_RULES, COMPLETION_RULES, Origin, Support
from web.responses_fields import RESPONSES_RULES


def render() -> str:
    """docs/openai_fields.md."""
    parts = [
        "# OpenAI request fields\n",
        "What `/v1/completions`, `/v1/chat/completions` and `/v1/responses` do with each "
        "field that OpenAI or vLLM defines. Generated from "
        "[`web/openai_fields.py`](../web/openai_fields.py) and "
        "[`web/responses_fields.py`](../web/responses_fields.py) "
        "(`python -m web.openai_fields_doc > docs/openai_fields.md`); a test checks that "
        "this page and the code agree.\n",
        "- **supported**: honoured as described; out-of-range values get a 400 naming "
        "the field.\n- **some values**: the values listed are honoured; any other is "
        'refused.\n- **refused**: a 400 in OpenAI\'s error shape (`{"error": {"message", '
        '"type", "param", "code"}}`) whose `param` and message name the field.\n\n'
        'A field in neither table is refused as unknown. `null` means "not set" for '
        "every field, so a refused field sent as `null` is not refused.\n",
    ]
    for title, rules in (
        ("POST /v1/completions", COMPLETION_RULES),
        ("POST /v1/chat/completions", CHAT_RULES),
        ("POST /v1/responses", RESPONSES_RULES),
    ):
        parts.append(f"## {title}\n\n| field | from | status | why |\n|---|---|---|---|")
        order = list(Support), list(Origin)
        for rule in sorted(
            rules.values(), key=lambda r: (order[0].index(r.support), order[1].index(r.origin))
        ):
            status = rule.support.value
            if rule.support is Support.SOME_VALUES:
                status = f"only {rule.values}"
            parts.append(f"| `{rule.name}` | {rule.origin} | {status} | {rule.why} |")
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
