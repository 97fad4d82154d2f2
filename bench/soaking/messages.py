"""The generate messages and HTTP bodies of the mix, drawn from a request's seeded rng.

`long` is False for the short requests of the main load (4..64 tokens), True for long
ones that outlast a cancel or disconnect (64..256 tokens, ignore_eos), or a token count
(the probes and the fault phase)."""

from __future__ import annotations

import random

from .context import Ctx

SYSTEMS = ("You tell short stories.", "Answer kindly.", "You are a friendly bear.")


def ws_params(rng: random.Random, long: bool | int = False) -> dict:
    """Sampling fields of one request: short outputs, or `long` ones (module doc); some
    seeded, some nucleus-sampled."""
    if long is True:
        params = {"max_tokens": rng.randint(64, 256), "ignore_eos": True}
    elif long:  # a token count: the probes and the fault phase
        params = {"max_tokens": long, "ignore_eos": True}
    else:
        params = {"max_tokens": rng.randint(4, 64)}
    params["temperature"] = rng.choice((0.0, 0.7, 1.0))
    if rng.random() < 0.4:
        params["seed"] = rng.randrange(1 << 20)
    if rng.random() < 0.3:
        params["top_p"] = 0.9
    return params


def ws_generate_message(ctx: Ctx, rng: random.Random, long: bool | int = False) -> dict:
    message = {"type": "generate", "id": ctx.new_id(), "params": ws_params(rng, long)}
    if rng.random() < 0.25:
        message["messages"] = [{"role": "user", "content": rng.choice(ctx.prompts)}]
    else:
        message["prompt"] = rng.choice(ctx.prompts)
    return message


def turn_message(ctx: Ctx, rng: random.Random, sid: str) -> dict:
    """One turn of session `sid`."""
    return {
        "type": "generate",
        "id": ctx.new_id(),
        "session_id": sid,
        "message": rng.choice(ctx.prompts),
        "params": ws_params(rng),
    }


def http_body(
    ctx: Ctx, rng: random.Random, chat: bool, stream: bool, long: bool | int = False
) -> dict:
    """A completions (or, with `chat`, chat completions) body; short ones may ask n=2."""
    body = ws_params(rng, long)
    if not long and rng.random() < 0.2:
        body["n"] = 2
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(ctx.prompts)}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    else:
        body["prompt"] = rng.choice(ctx.prompts)
    if stream:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    return body


def oversize_prompt(ctx: Ctx, rng: random.Random) -> str:
    """A prompt 1..4096 bytes over --max-message-bytes."""
    return "a" * (ctx.args.max_message_bytes + rng.randint(1, 4096))
