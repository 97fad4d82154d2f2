"""Prefill/decode disaggregation served: a `kv_producer` server computes each prompt and
holds its KV blocks, a `kv_consumer` server loads them and decodes, `vllm-router
--vllm-pd-disaggregation` in front (it sends the prompt to the producer with
`max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`, then the request to
the consumer with the producer's answer). Greedy chat and completions, streamed and
not, give a lone server's text; the consumer computes one prompt token per transferred
request (the last, for its logits) and loads the rest; a consumer with another cluster
secret is refused (the producer logs it) and its request fails; a producer gone before
the transfer fails the request within 10 s; and the pair works across a network
namespace. Router tests skip, saying so, where vllm-router is not installed."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.eventually import eventually_sync
from tests.web.conftest import RunningServer, start_server, stop_server
from tests.web.test_vllm_router import healthy, router_binary
from web.launch import ServerProcess, free_ports

pytestmark = pytest.mark.timeout(240)

SECRET = "prefill-decode-test-secret-0123456789"
MODEL = "pagedserve-builtin-tiny"
PROMPTS = ["Once upon a time there was a dog", "The cat sat on the mat and", "Tom said"]


def kv_config(role: str, port: int | None = None, ip: str = "127.0.0.1") -> list[str]:
    config = {"kv_connector": "PagedServeConnector", "kv_role": role, "kv_ip": ip}
    if port is not None:
        config["kv_port"] = port
    return ["--kv-transfer-config", json.dumps(config)]


def start_producer(env: dict[str, str]) -> RunningServer:
    """A kv_producer on loopback; its HTTP and KV ports differ."""
    http, kv = free_ports(2)
    return start_server(extra=kv_config("kv_producer", kv), env=env, port=http)


def post(url: str, body: dict) -> tuple[int, dict | str]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            text = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    return status, text if body.get("stream") else json.loads(text)


def chat(prompt: str, **extra) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}


def completion(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}


def streamed_text(sse: str, chat_chunks: bool) -> str:
    text = []
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            text.append(choice["delta"].get("content") or "" if chat_chunks else choice["text"])
    return "".join(text)


def counter(server: RunningServer, name: str) -> float:
    return server.metric(f"pagedserve_{name}_total")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The producer reads the secret from its environment, the consumer from a file."""
    env = {"PAGEDSERVE_CLUSTER_SECRET": SECRET}
    producer = start_producer(env)
    secret_file = tmp_path_factory.mktemp("secret") / "cluster.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    consumer = start_server(
        extra=[*kv_config("kv_consumer"), "--cluster-secret-file", str(secret_file)]
    )
    lone = start_server()
    try:
        yield producer, consumer, lone
    finally:
        for server in (producer, consumer, lone):
            stop_server(server)


def handoff(producer: RunningServer, body: dict, path: str = "/v1/completions") -> dict:
    """The producer's answer to a do_remote_decode request: where the KV waits."""
    remote = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, reply = post(f"{producer.http}{path}", remote)
    assert status == 200, reply
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] and params["remote_block_ids"]
    return params


def test_a_handed_off_prompt_decodes_as_a_lone_server_does(pair) -> None:
    producer, consumer, lone = pair
    for prompt in PROMPTS:
        body = completion(prompt)
        computed = counter(consumer, "prompt_tokens_computed")
        loaded = counter(consumer, "kv_transfer_loaded_tokens")
        params = handoff(producer, body)
        status, got = post(
            f"{consumer.http}/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 200, got
        _, want = post(f"{lone.http}/v1/completions", body)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        prompt_tokens = got["usage"]["prompt_tokens"]
        assert counter(consumer, "prompt_tokens_computed") - computed == 0
        assert counter(consumer, "kv_transfer_loaded_tokens") - loaded == prompt_tokens


@contextlib.contextmanager
def routed(prefill: str, decode: str):
    """`vllm-router --vllm-pd-disaggregation` in front of a pair; yields its URL."""
    port, metrics_port = free_ports(2)
    router = subprocess.Popen(
        [router_binary(), "--vllm-pd-disaggregation", "--policy", "round_robin"]
        + ["--prefill", prefill, "--decode", decode]
        + ["--host", "127.0.0.1", "--port", str(port), "--worker-startup-timeout-secs", "60"]
        + ["--prometheus-port", str(metrics_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        eventually_sync(lambda: healthy(url), timeout=60, what="vllm-router's /health")
        yield url
    finally:
        router.terminate()
        router.wait(timeout=20)


def test_the_router_splits_chat_and_completions_streamed_and_not(pair) -> None:
    producer, consumer, lone = pair
    with routed(producer.http, consumer.http) as url:
        loaded = counter(consumer, "kv_transfer_loaded_tokens")
        for prompt in PROMPTS:
            _, want = post(f"{lone.http}/v1/chat/completions", chat(prompt))
            expected = want["choices"][0]["message"]["content"]
            status, got = post(f"{url}/v1/chat/completions", chat(prompt))
            assert status == 200, got
            assert got["choices"][0]["message"]["content"] == expected
            _, sse = post(f"{url}/v1/chat/completions", chat(prompt, stream=True))
            assert streamed_text(sse, chat_chunks=True) == expected
            _, want = post(f"{lone.http}/v1/completions", completion(prompt))
            _, sse = post(f"{url}/v1/completions", completion(prompt, stream=True))
            assert streamed_text(sse, chat_chunks=False) == want["choices"][0]["text"]
        assert counter(consumer, "kv_transfer_loaded_tokens") > loaded


def test_a_consumer_with_another_secret_is_refused(pair, tmp_path) -> None:
    """Its fetches are sealed with the wrong secret: the producer refuses and logs them
    and never answers, so the load fails at the consumer's fetch timeout."""
    _, consumer, _ = pair
    log = open(tmp_path / "producer.log", "wb")  # noqa: SIM115 - closed below
    http, kv = free_ports(2)
    producer = ServerProcess(
        ["--model", "builtin:tiny", "--kv-cache-memory", str(64 << 20)]
        + kv_config("kv_producer", kv),
        port=http,
        env={"PAGEDSERVE_CLUSTER_SECRET": "s" * 40, "OMP_NUM_THREADS": "1"},
        log=log,
    )
    producer.start(timeout=120)
    try:
        body = completion(PROMPTS[0])
        params = handoff(RunningServer(producer.port, MODEL, None, None, producer), body)
        status, reply = post(
            f"{consumer.http}/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 500 and "loading its KV cache" in reply["error"]["message"]
        logged = (tmp_path / "producer.log").read_text(errors="replace")
        assert "refused" in logged and "bad tag" in logged, logged[-2000:]
    finally:
        producer.stop()
        log.close()


def test_a_producer_gone_fails_the_request_within_ten_seconds(pair) -> None:
    _, consumer, _ = pair
    env = {"PAGEDSERVE_CLUSTER_SECRET": SECRET}
    producer = start_producer(env)
    body = completion(PROMPTS[1])
    params = handoff(producer, body)
    stop_server(producer)
    started = time.monotonic()
    status, reply = post(f"{consumer.http}/v1/completions", {**body, "kv_transfer_params": params})
    assert time.monotonic() - started < 10
    assert status == 500 and "loading its KV cache" in reply["error"]["message"]
    status, _ = post(f"{consumer.http}/v1/completions", body)  # and the consumer goes on
    assert status == 200


def test_a_pair_across_a_network_namespace(two_hosts, tmp_path) -> None:
    """The producer in the other namespace: its HTTP and its KV cross the veth link,
    directly and behind the router."""
    env = {"PAGEDSERVE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "producer.log", "wb")  # noqa: SIM115 - closed below
    http, kv = free_ports(2)
    producer = ServerProcess(
        ["--model", "builtin:tiny", "--kv-cache-memory", str(64 << 20), "--host", "0.0.0.0"]
        + kv_config("kv_producer", kv, ip=two_hosts.worker_ip),
        port=http,
        env=env,
        log=log,
        prefix=two_hosts.exec_prefix,
        host=two_hosts.worker_ip,
    )
    producer.start(timeout=120)
    consumer = start_server(extra=kv_config("kv_consumer"), env=env)
    try:
        body = completion(PROMPTS[2])
        remote = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = post(f"{producer.url}/v1/completions", remote)
        assert status == 200, reply
        params = reply["kv_transfer_params"]
        assert params["remote_host"] == two_hosts.worker_ip
        status, got = post(
            f"{consumer.http}/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 200, got
        _, want = post(f"{consumer.http}/v1/completions", body)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        with routed(producer.url, consumer.http) as url:
            _, want = post(f"{consumer.http}/v1/chat/completions", chat(PROMPTS[0]))
            status, got = post(f"{url}/v1/chat/completions", chat(PROMPTS[0]))
            assert status == 200, got
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
    finally:
        stop_server(consumer)
        producer.stop()
        log.close()
