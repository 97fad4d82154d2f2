"""`kv_transfer_config` and `kv_transfer_params` (engine/kv_transfer/): vLLM's keys and
spelling, defaults, and every bad key or value refused by name with what it may be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.codec import InboxDecoder, encode
from engine.kv_transfer.config import (
    CONNECTOR,
    DEFAULT_FETCH_TIMEOUT_S,
    KVRole,
    KVTransferConfig,
)
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.wire import PRODUCER_INBOX, FetchBlocks

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]

PRODUCER = {
    "kv_connector": "PagedServeConnector",
    "kv_role": "kv_producer",
    "kv_ip": "10.0.0.5",
    "kv_port": 14600,
    "engine_id": "prefill-0",
}


def test_vllm_json_parses_into_a_frozen_config():
    config = KVTransferConfig.from_json(json.dumps(PRODUCER))
    assert config.kv_connector == CONNECTOR
    assert config.kv_role is KVRole.PRODUCER
    assert (config.kv_ip, config.kv_port, config.engine_id) == ("10.0.0.5", 14600, "prefill-0")
    assert config.address == "tcp://10.0.0.5:14600"
    assert config.fetch_timeout_s == DEFAULT_FETCH_TIMEOUT_S < 10
    with pytest.raises(AttributeError):
        config.kv_port = 1


def test_defaults_and_extra_config():
    config = KVTransferConfig.parse(
        {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_both",
            "kv_buffer_size": 1e9,
            "kv_connector_extra_config": {"fetch_timeout_s": 2, "hold_timeout_s": 30.5},
        }
    )
    assert config.kv_role.produces and config.kv_role.consumes
    assert (config.kv_ip, config.kv_port) == ("127.0.0.1", 14579)
    assert config.kv_buffer_size == 1_000_000_000
    assert (config.fetch_timeout_s, config.hold_timeout_s) == (2.0, 30.5)
    assert len(config.engine_id) == 36  # a fresh uuid
    other = KVTransferConfig.parse({"kv_connector": CONNECTOR, "kv_role": "kv_consumer"})
    assert other.engine_id != config.engine_id
    assert not other.kv_role.produces and other.kv_role.consumes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kv_role": "prefill"},
            r"kv_role must be one of \['kv_producer', 'kv_consumer', 'kv_both'\]; got 'prefill'",
        ),
        ({"kv_role": None}, r"'kv_role' is required"),
        ({"kv_connector": None}, r"'kv_connector' is required"),
        (
            {"kv_connector": "TcpConnector"},
            r"kv_connector must be one of \['PagedServeConnector', 'NixlConnector'",
        ),
        (
            {"kv_connector": "NixlConnector"},
            r"'NixlConnector' needs the 'nixl' package, which is not installed; "
            r"use 'PagedServeConnector'",
        ),
        (
            {"kv_connector": "P2pNcclConnector"},
            r"'P2pNcclConnector' is vLLM's and is not implemented here",
        ),
        ({"kv_port": 70000}, r"kv_port must be an int in \[0, 65535\]; got 70000"),
        ({"kv_port": "14579"}, r"kv_port must be an int in \[0, 65535\]; got '14579'"),
        ({"kv_port": True}, r"kv_port must be an int"),
        ({"kv_ip": ""}, r"kv_ip must be a non-empty string"),
        ({"engine_id": 7}, r"engine_id must be a non-empty string; got 7"),
        ({"kv_buffer_size": 0}, r"kv_buffer_size must be an int in \[1, "),
        ({"kv_rank": 0}, r"'kv_rank' not supported; allowed keys: \['engine_id', 'kv_buffer_size'"),
        (
            {"kv_buffer_device": "cuda", "kv_parallel_size": 2},
            r"'kv_buffer_device', 'kv_parallel_size' not supported",
        ),
        (
            {"kv_connector_extra_config": {"backends": ["UCX"]}},
            r"'kv_connector_extra_config.backends' not supported; "
            r"allowed keys: \['kv_connector_extra_config.fetch_timeout_s'",
        ),
        (
            {"kv_connector_extra_config": {"fetch_timeout_s": 0}},
            r"fetch_timeout_s must be > 0 and <= 600 seconds; got 0",
        ),
        (
            {"kv_connector_extra_config": {"hold_timeout_s": "1m"}},
            r"hold_timeout_s must be a number of seconds; got '1m'",
        ),
        ({"kv_connector_extra_config": []}, r"kv_connector_extra_config must be an object"),
    ],
)
def test_bad_config_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse({**PRODUCER, **change})


def test_config_that_is_not_an_object_or_not_json():
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVTransferConfig.parse(["kv_producer"])
    with pytest.raises(ValueError, match="kv_transfer_config is not valid JSON"):
        KVTransferConfig.from_json("{kv_role: kv_producer}")


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig(CONNECTOR, "kv_producer")
    assert KVTransferConfig(CONNECTOR, KVRole.CONSUMER, kv_ip="::1").address.startswith(
        "tcp://[::1]:"
    )


RESPONSE = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_block_ids": [4, 9, 2],
    "remote_host": "10.0.0.5",
    "remote_port": 14600,
    "remote_request_id": "cmpl-1",
}


def test_params_round_trip_through_dicts_json_and_the_codec():
    params = KVTransferParams.from_dict(RESPONSE)
    assert params.remote_block_ids == (4, 9, 2)
    assert params.remote_address == "tcp://10.0.0.5:14600"
    assert params.to_dict() == RESPONSE
    assert KVTransferParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    fetch = FetchBlocks("cmpl-1", params.remote_block_ids, "prefill-0", "f1")
    assert InboxDecoder(PRODUCER_INBOX).decode(encode(fetch)) == fetch


def test_what_a_proxy_sends_the_prefill_instance():
    sent = KVTransferParams.from_dict(
        {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    )
    assert sent == KVTransferParams.remote_decode()
    assert sent.to_dict()["remote_block_ids"] is None
    with pytest.raises(ValueError, match="no remote_host and remote_port"):
        _ = sent.remote_address


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_port": "14600"}, r"remote_port must be an int in \[1, 65535\]; got '14600'"),
        ({"remote_port": 0}, r"remote_port must be an int in \[1, 65535\]; got 0"),
        (
            {"remote_block_ids": [1, -2]},
            r"remote_block_ids must be a list of block ids \(ints >= 0\); got \[1, -2\]",
        ),
        ({"remote_block_ids": [1, True]}, r"remote_block_ids must be a list of block ids"),
        ({"remote_block_ids": "1,2"}, r"remote_block_ids must be a list of block ids"),
        ({"remote_engine_id": ""}, r"remote_engine_id must be a non-empty string; got ''"),
        ({"remote_host": 10}, r"remote_host must be a non-empty string; got 10"),
        ({"do_remote_prefill": 1}, r"do_remote_prefill must be true or false; got 1"),
        ({"do_remote_decode": True}, r"do_remote_decode and do_remote_prefill cannot both be true"),
        (
            {"remote_host": None, "remote_request_id": None},
            r"do_remote_prefill needs 'remote_host', 'remote_request_id'",
        ),
        ({"tp_size": 1}, r"'tp_size' not supported; allowed keys: \['do_remote_decode'"),
    ],
)
def test_bad_params_are_refused_by_key(change, message):
    with pytest.raises(ValueError, match=message):
        KVTransferParams.from_dict({**RESPONSE, **change})


def test_params_that_are_not_an_object():
    with pytest.raises(ValueError, match="kv_transfer_params must be an object"):
        KVTransferParams.from_dict([RESPONSE])


@pytest.mark.timeout(120)
def test_the_scheduler_side_modules_do_not_import_torch():
    modules = ["config", "params", "payload", "connector", "held_blocks", "wire"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('engine.kv_transfer.' + m)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
