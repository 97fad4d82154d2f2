"""Rendering chat templates in child processes that can be stopped.

A template is untrusted code (it can come inside a downloaded GGUF file). In-process,
`engine.text.chat_template.render` bounds its output and each `*`/`**`, but nothing can
stop a Python thread that loops, or undo what it allocated some other way. Here every
render runs in a small child process (`python -m actors.template_renderer`: Jinja and
msgpack, no torch, about 20 MB) under an address-space limit, and the caller waits for
it with a deadline: past the deadline the child is killed, the render fails with a
ChatTemplateError for that request only, and the next render gets a fresh child.

`IsolatedRenderer.render` is called from admission threads, any number at once: each
call takes an idle child from a pool (starting one when none is idle), so one slow
render never queues another behind it. Children exit when their stdin closes and are
killed with their parent (PR_SET_PDEATHSIG) on Linux.

Frames on the pipes are a 4-byte big-endian length and a msgpack map: first
{source, name, variables, max_chars, memory_bytes} to the child, then per render
{messages, add_generation_prompt, variables?} → {text} or {error, recycle}.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

import msgpack

from engine.child_process import start_module
from engine.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateBudget,
    TemplateBudgetError,
    check_template,
    render,
)
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_START_TIMEOUT_S = 30.0  # a child's import of Jinja, on a loaded machine
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


class _Child:
    """One renderer process and its pipes."""

    def __init__(self, template: ChatTemplate, budget: TemplateBudget) -> None:
        self.proc = _spawn()
        init = {
            "source": template.source,
            "name": template.name,
            "variables": template.variables,
            "max_chars": budget.max_chars,
            "memory_bytes": budget.memory_bytes,
        }
        self.send(init)
        self.receive(_START_TIMEOUT_S)  # {"ready": True}

    def send(self, message: dict) -> None:
        _write(self.proc.stdin, message)

    def receive(self, timeout_s: float) -> dict:
        """The child's next frame; TimeoutError past `timeout_s`, EOFError if it died."""
        deadline = time.monotonic() + timeout_s
        header = _read_exactly(self.proc.stdout, _HEADER.size, deadline)
        return msgpack.unpackb(_read_exactly(self.proc.stdout, _HEADER.unpack(header)[0], deadline))

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class IsolatedRenderer:
    """A ChatRenderer whose renders run in killable child processes (see the module
    docstring): each within `budget.deadline_s`, `budget.memory_bytes` of address
    space and `budget.max_chars` of output, else ChatTemplateError naming the template."""

    def __init__(self, template: ChatTemplate, budget: TemplateBudget | None = None) -> None:
        self.template = template
        self.budget = budget or TemplateBudget()
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self.num_killed = 0  # children killed past their deadline or crashed

    def render(
        self, messages: list[dict], add_generation_prompt: bool, variables: dict | None = None
    ) -> str:
        child = self._checkout()
        frame = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            child.send(frame | ({"variables": variables} if variables else {}))
            reply = child.receive(self.budget.deadline_s)
        except TimeoutError:
            self._discard(child)
            raise ChatTemplateError(
                f"{self.template.name} took longer than {self.budget.deadline_s:g} s to "
                "render these messages"
            ) from None
        except (EOFError, OSError):
            self._discard(child)
            raise ChatTemplateError(f"{self.template.name} crashed rendering") from None
        if reply.get("recycle"):
            self._discard(child)
        else:
            self._checkin(child)
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply["text"]

    def warm(self) -> None:
        """Starts one child now (start-up), so the first chat does not wait for one."""
        self._checkin(self._checkout())

    def close(self) -> None:
        """Kills every child; renders after this raise ChatTemplateError."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for child in idle:
            child.kill()

    def _checkout(self) -> _Child:
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the chat template renderer is shut down")
            if self._idle:
                return self._idle.pop()
        try:
            return _Child(self.template, self.budget)
        except (TimeoutError, EOFError, OSError) as exc:
            raise ChatTemplateError(f"could not start a chat template renderer: {exc}") from None

    def _checkin(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()

    def _discard(self, child: _Child) -> None:
        self.num_killed += 1
        child.kill()
        logger.warning("chat template renderer %d stopped and replaced", child.proc.pid)


def isolate_templates(tokenizer: Tokenizer | None) -> IsolatedRenderer | None:
    """Moves `tokenizer`'s chat template renders into child processes, after checking
    that the template renders (ChatTemplateError naming it otherwise: a template that
    fails on every conversation stops start-up). Returns the renderer, for its owner to
    close; None where there is no template."""
    if tokenizer is None or tokenizer.chat_template is None:
        return None
    renderer = IsolatedRenderer(tokenizer.chat_template)
    try:
        check_template(renderer, tokenizer.chat_template.name)
    except BaseException:
        renderer.close()
        raise
    tokenizer.renderer = renderer
    return renderer


def _spawn() -> subprocess.Popen:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    return start_module("actors.template_renderer", [], popen_kwargs=pipes)


def _write(out: BinaryIO, message: dict[str, Any]) -> None:
    """One frame (both ends write them this way)."""
    data = msgpack.packb(message)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _read_exactly(pipe: BinaryIO, n: int, deadline: float) -> bytes:
    chunks, left = [], n
    fd = pipe.fileno()
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---- the child ------------------------------------------------------------------------


def _die_with_parent() -> None:
    name = ctypes.util.find_library("c")
    if name and sys.platform.startswith("linux"):
        ctypes.CDLL(name).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _limit_memory(extra_bytes: int) -> None:
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * resource.getpagesize()
    limit = current + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _read(inp: BinaryIO) -> dict | None:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return msgpack.unpackb(inp.read(_HEADER.unpack(header)[0]))


def child_main() -> None:
    """The renderer process: one init frame, then one reply per render frame, until its
    stdin closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    init = _read(inp)
    if init is None:
        return
    template = ChatTemplate(init["source"], init["name"], init["variables"])
    if sys.platform.startswith("linux"):
        _limit_memory(init["memory_bytes"])
    _write(out, {"ready": True})
    while (frame := _read(inp)) is not None:
        try:
            messages, prompt = frame["messages"], frame["add_generation_prompt"]
            variables = frame.get("variables")
            text = render(template, messages, prompt, init["max_chars"], variables)
            _write(out, {"text": text})
        except ChatTemplateError as exc:
            _write(out, {"error": str(exc), "recycle": isinstance(exc, TemplateBudgetError)})


if __name__ == "__main__":
    child_main()
