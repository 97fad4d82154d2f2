"""The hostile chat template and the template-trigger phase: a chat that makes the
template loop must fail alone, as a 400, while plain completions go on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from .context import Ctx
from .stopwatch import count_statuses, latency, timed_completion

TRIGGER = "xyzzy-trigger"
HOSTILE_TEMPLATE = (  # stories260K's own template (Q: / A: lines) and the trigger branch
    "{{ bos_token }}{% for m in messages %}"
    "{% if '" + TRIGGER + "' in m['content'] %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'A: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)
TRIGGER_ANSWER_S = 2.5  # a trigger chat must be refused by then
PLAIN_ANSWER_S = 2.0  # a plain completion beside the triggers must be answered by then
TRIGGER_NAMES = "--chat-template"  # what the refusal's message must name


def write_template(directory: Path) -> Path:
    """HOSTILE_TEMPLATE in a file under `directory`: a complete template (bos, a line
    per message, the generation prompt) that loops for hours on a message containing
    TRIGGER."""
    path = directory / "hostile_chat_template.jinja"
    path.write_text(HOSTILE_TEMPLATE)
    return path


async def trigger_chat(ctx: Ctx) -> dict:
    """One chat whose message holds TRIGGER: {"status", "s", "names_template"}."""
    body = {
        "messages": [{"role": "user", "content": f"Tell me a story {TRIGGER}"}],
        "max_tokens": 4,
    }
    start = time.monotonic()
    try:
        response = await ctx.http.post(ctx.completions_url(True), json=body, timeout=30.0)
        status, text = response.status_code, response.text
    except httpx.HTTPError as exc:
        status, text = None, type(exc).__name__
    return {
        "status": status,
        "s": round(time.monotonic() - start, 3),
        "names_template": TRIGGER_NAMES in text and "invalid_request" in text,
    }


async def template_trigger(ctx: Ctx, triggers: int, concurrency: int = 1) -> dict:
    """`triggers` trigger chats (`concurrency` at a time) while plain one-token
    completions run one after another until the triggers are answered."""
    done = asyncio.Event()
    gate = asyncio.Semaphore(concurrency)

    async def one() -> dict:
        async with gate:
            return await trigger_chat(ctx)

    async def plain_loop() -> list[dict]:
        out = [await timed_completion(ctx)]
        while not done.is_set():
            out.append(await timed_completion(ctx))
        return out

    plain = asyncio.create_task(plain_loop())
    answers = await asyncio.gather(*(one() for _ in range(triggers)))
    done.set()
    plains = await plain
    return {
        "triggers": len(answers),
        "trigger_statuses": count_statuses(a["status"] for a in answers),
        "trigger_named_template": sum(a["names_template"] for a in answers),
        "trigger_latency": latency([a["s"] for a in answers]),
        "plain_statuses": count_statuses(p["status"] for p in plains),
        "plain_latency": latency([p["s"] for p in plains]),
    }


def trigger_failures(t: dict | None) -> list[str]:
    """Every trigger a 400 naming the template within TRIGGER_ANSWER_S; every plain
    completion a 200 within PLAIN_ANSWER_S."""
    if t is None:
        return []
    out = []
    if (
        t["trigger_statuses"] != {"400": t["triggers"]}
        or t["trigger_named_template"] != t["triggers"]
    ):
        out.append(
            f"template trigger: answers {t['trigger_statuses']}, "
            f"{t['trigger_named_template']} naming {TRIGGER_NAMES}"
        )
    if (t["trigger_latency"]["max_s"] or 0) > TRIGGER_ANSWER_S:
        out.append(f"template trigger: slowest refusal {t['trigger_latency']['max_s']} s")
    if set(t["plain_statuses"]) != {"200"}:
        out.append(f"template trigger: plain completions {t['plain_statuses']}")
    if (t["plain_latency"]["max_s"] or 0) > PLAIN_ANSWER_S:
        out.append(f"template trigger: slowest plain completion {t['plain_latency']['max_s']} s")
    return out
