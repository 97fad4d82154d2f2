"""A mixture of experts served (`pagedserve serve` on a tiny Mixtral): every expert's
(token, expert) assignments so far reach /metrics as
`pagedserve_moe_expert_tokens_total{expert}` through the worker's heartbeats, and they
add up to the tokens computed times top-k times the MoE layers."""

from __future__ import annotations

import json
import urllib.request

import pytest

from engine.worker.builtin_model import NUM_BYTES
from engine.worker.builtin_model import _write_tokenizer as write_byte_tokenizer
from tests.engine.tiny_models import save_hf_model
from tests.eventually import eventually_sync
from tests.web.conftest import start_server, stop_server

pytestmark = pytest.mark.timeout(180)


def expert_tokens(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("pagedserve_moe_expert_tokens_total{"):
            expert = line.split('expert="')[1].split('"')[0]
            found[expert] = float(line.split()[-1])
    return found


def test_the_load_per_expert_is_a_metric(tmp_path) -> None:
    model = save_hf_model("mixtral", tmp_path, vocab_size=NUM_BYTES + 2)
    write_byte_tokenizer(tmp_path)  # the built-in model's: 256 bytes, BOS and EOS
    config = model.config
    server = start_server(model_dir=str(tmp_path))
    try:
        body = {"model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 6}
        body["ignore_eos"] = True
        body["temperature"] = 0
        request = urllib.request.Request(
            f"{server.http}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.load(reply)["usage"]["completion_tokens"] == 6
        # 4 prompt tokens and 5 decoded ones computed (the last token is only sampled)
        computed = 4 + 5
        want = computed * config.num_experts_per_tok * config.num_hidden_layers
        eventually_sync(
            lambda: sum(expert_tokens(server).values()) >= want,
            timeout=10,
            what=lambda: f"the experts' load {expert_tokens(server)} (want {want} in all)",
        )
        load = expert_tokens(server)
        assert len(load) == config.num_local_experts and sum(load.values()) == want
    finally:
        stop_server(server)
