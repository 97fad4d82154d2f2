"""The Starlette app: WebSocket streaming, OpenAI HTTP, health, metrics, the chat page.

`create_app(engine_args, config)` starts the AsyncEngine (or, with
`config.data_parallel_size` > 1, a ReplicaSet of that many) in the app's lifespan and
shuts it down (aborting open requests, stopping the workers) when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from actors.engine_client import EngineClient
from actors.engine_status import EngineStatus
from actors.replica_set import ReplicaSet
from actors.restarting_engine import RestartingEngine
from actors.worker_launch import WorkerLaunch
from engine.config import EngineConfig
from engine.engine_args import EngineArgs
from web.api_keys import ApiKeys, bearer_key
from web.client_concurrency import ClientConcurrency
from web.error_counter import ErrorAnswerCounter
from web.errors import ApiError, invalid
from web.generation import Admission, Generator
from web.metrics import Metrics
from web.openai_routes import OpenAIRoutes
from web.redaction import hide_paths
from web.responses_route import ResponsesRoute
from web.server_config import ServerConfig
from web.sessions import SessionStore
from web.stats_logger import StatsLogger
from web.tokenize_routes import TokenizeRoutes
from web.ws_connection import SHUTDOWN_CLOSE, StreamConnection, StreamLimits

logger = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


class ApiKeyMiddleware:
    """With API keys configured, every HTTP route but /health (and the static chat page)
    needs `Authorization: Bearer KEY` (exactly one such header: several are a 400);
    WebSockets check their own (header or first message)."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys) -> None:
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_keys or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        try:
            key = bearer_key(values)
        except ValueError as exc:  # several headers: refused, whichever holds a key
            err = invalid(str(exc), "Authorization")
        else:
            if self.api_keys.matches(key):
                await self.app(scope, receive, send)
                return
            err = ApiError("unauthorized", "invalid or missing API key (Authorization: Bearer KEY)")
        await JSONResponse(err.openai_body(), err.status)(scope, receive, send)


def _is_open(path: str) -> bool:
    return path == "/" or path == "/health" or path.startswith("/static/")


class Server:
    """The app's state: the engine and the web-side objects around it.

    `drain()` is the graceful shutdown (run on SIGINT/SIGTERM before the engine stops)."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.admission = Admission(config.max_queued_requests)
        self.sessions = SessionStore(config.session_ttl_s, config.session_max_chars)
        self.connections: set[StreamConnection] = set()
        self.metrics = Metrics(
            engine.stats,
            engine.watch_stats,
            self._web_gauges(),
            config.model_name,
            engine.ready.max_model_len,
            engine.replica_statuses,
            engine.replica_stats,
        )
        self.stats_logger = StatsLogger(
            engine.stats, self.metrics.token_totals, config.log_stats_interval_s
        )
        per_client = ClientConcurrency(config.max_concurrent_per_key)
        self.generator = Generator(engine, self.metrics, self.admission, per_client)
        self.openai = OpenAIRoutes(self.generator, config)
        self.responses_route = ResponsesRoute(self.openai, config)
        self.tokenizing = TokenizeRoutes(self.generator, config, engine.ready.max_model_len)
        self.limits = StreamLimits(
            config.max_requests_per_connection,
            config.default_max_tokens,
            config.ws_auth_timeout_s,
        )

    def _web_gauges(self) -> dict:
        return {
            "pagedserve_num_requests_queued": (
                "Requests admitted, no token yet",
                lambda: self.admission.queued,
            ),
            "pagedserve_num_requests_live": (
                "Requests the web layer is serving (any protocol)",
                lambda: len(self.generator.live),
            ),
            "pagedserve_num_sessions": ("Open chat sessions", lambda: len(self.sessions)),
            "pagedserve_num_ws_connections": (
                "Open WebSocket connections",
                lambda: len(self.connections),
            ),
        }

    async def drain(self) -> None:
        """Refuses new requests, lets the live ones finish within the configured grace,
        aborts the rest (each stream still ends with its `done` / final chunk), then
        closes the WebSockets with 1001 (going away)."""
        grace = self.config.shutdown_grace_s
        logger.info("draining %d requests (grace %.1f s)", len(self.generator.live), grace)
        aborted = await self.generator.drain(grace)
        closing = [c.close(SHUTDOWN_CLOSE, "server shutting down") for c in self.connections]
        await asyncio.gather(*closing)
        logger.info("drained: %d requests aborted, %d WebSockets closed", aborted, len(closing))

    async def health(self, request: Request) -> Response:
        """200 `ok` or `degraded` (some data-parallel replicas down, the others serving);
        503 `draining`, `restarting` (a dead worker being replaced) or `unhealthy`."""
        if self.generator.draining:
            return JSONResponse({"status": "draining"}, 503)
        status = self.engine.status
        if status is EngineStatus.OK:
            return JSONResponse({"status": "ok"})
        body = {"status": status.value, "replicas": list(self.engine.replica_statuses())}
        if status is EngineStatus.DEGRADED:
            return JSONResponse(body)
        return JSONResponse({**body, "error": self.engine.error}, 503)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedserve",
            "builtin": self.config.builtin,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def stream(self, ws: WebSocket) -> None:
        binary = ws.query_params.get("encoding") == "msgpack"
        if self.generator.draining:
            await ws.close(SHUTDOWN_CLOSE)  # refused before the handshake completes
            return
        conn = StreamConnection(
            ws, self.generator, self.sessions, self.limits, self.config.api_keys, binary
        )
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    async def completions(self, request: Request) -> Response:
        return await self.openai.completions(request)

    async def chat_completions(self, request: Request) -> Response:
        return await self.openai.chat_completions(request)

    async def responses(self, request: Request) -> Response:
        return await self.responses_route.responses(request)

    async def tokenize(self, request: Request) -> Response:
        return await self.tokenizing.tokenize(request)

    async def detokenize(self, request: Request) -> Response:
        return await self.tokenizing.detokenize(request)

    async def version(self, request: Request) -> Response:
        return await self.tokenizing.version(request)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def info(self, request: Request) -> Response:
        """What is served and how; no file paths (the model is its served name)."""
        return JSONResponse(
            {
                "model": self.config.model_name,
                "builtin": self.config.builtin,
                "auth": bool(self.config.api_keys),
                "attention_backend": self.engine.ready.attention_backend,
                "attention_backend_reason": hide_paths(self.engine.ready.attention_backend_reason),
                "memory": memory_info(self.engine.ready),
                "data_parallel_size": self.config.data_parallel_size,
            }
        )


def memory_info(ready) -> dict:
    """/v1/info's "memory": what the worker's weights and KV cache take (a WorkerReady's
    figures; per worker under data parallelism) and how many max_model_len sequences
    the cache holds at once."""
    return {
        "weights_bytes": ready.weights_bytes,
        "quantization": ready.quantization,
        "kv_cache_bytes": ready.kv_cache_bytes,
        "kv_cache_dtype": ready.kv_cache_dtype,
        "max_concurrency": round(ready.num_blocks * ready.block_size / ready.max_model_len, 2),
    }


def _endpoint(name: str):
    """A route calling `name` on the app's Server (bound in the lifespan)."""

    async def endpoint(conn):  # a Request or a WebSocket
        return await getattr(conn.app.state.server, name)(conn)

    endpoint.__name__ = name
    return endpoint


def build_app(config: ServerConfig, lifespan=None, server: Server | None = None) -> Starlette:
    """The routes; the Server comes from `lifespan` (or is given, for an engine that is
    already running)."""
    routes = [
        Route("/health", _endpoint("health")),
        Route("/v1/models", _endpoint("models")),
        Route("/v1/info", _endpoint("info")),
        Route("/metrics", _endpoint("metrics_route")),
        Route("/v1/completions", _endpoint("completions"), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("chat_completions"), methods=["POST"]),
        Route("/v1/responses", _endpoint("responses"), methods=["POST"]),
        Route("/tokenize", _endpoint("tokenize"), methods=["POST"]),
        Route("/detokenize", _endpoint("detokenize"), methods=["POST"]),
        Route("/version", _endpoint("version")),
        Route("/", _endpoint("page")),
        WebSocketRoute("/v1/stream", _endpoint("stream")),
    ]
    middleware = [
        Middleware(ErrorAnswerCounter, count=_count_error_answer),  # outermost: sees all
        Middleware(ApiKeyMiddleware, api_keys=config.api_keys),
    ]
    errors = {404: _route_error, 405: _route_error}
    app = Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=errors
    )
    if server is not None:
        app.state.server = server
    return app


def _count_error_answer(scope: Scope, code: str) -> None:
    server = getattr(scope["app"].state, "server", None)
    if server is not None:
        server.metrics.refused(code)


async def _route_error(request: Request, exc: HTTPException) -> Response:
    """An unknown path (404) or a method a route does not take (405), in OpenAI's error
    shape like every other error (Starlette's default is plain text)."""
    path = request.url.path.encode("utf-8", "backslashreplace").decode("utf-8")[:200]
    where = f"{request.method} {path}"
    if exc.status_code == 404:
        message, kind = f"no route {where!r}: unknown path (see docs/serving.md)", "NotFoundError"
    else:
        allowed = exc.headers.get("Allow", "") if exc.headers else ""
        message = f"method not allowed: {where!r}; this path takes {allowed or 'another method'}"
        kind = "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": exc.status_code}}
    return JSONResponse(body, exc.status_code, headers=exc.headers)


def create_app(
    engine_args: EngineArgs,
    config: ServerConfig,
    engine_config: EngineConfig | None = None,
    launches: Sequence[WorkerLaunch] = (),
) -> Starlette:
    """The app with the engine's lifetime tied to the server's: started in the lifespan,
    shut down (open requests aborted, workers stopped) when the server stops.
    `engine_config` (`engine_args.build()`) and `launches` (the workers launched early,
    one per replica, so the model loads while the server starts): see
    `AsyncEngine.start` and `ReplicaSet.start`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = await start_engine(engine_args, config, engine_config, launches)
        server = app.state.server = Server(engine, config)
        note = " (built-in random-weight model: replies are noise)" if config.builtin else ""
        dp = config.data_parallel_size
        logger.info("serving %s%s%s", config.model_name, note, f" on {dp} replicas" * (dp > 1))
        stats_log = None
        if not config.disable_log_stats:
            stats_log = asyncio.create_task(server.stats_logger.run())
        try:
            yield
        finally:
            if stats_log is not None:
                stats_log.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_log
            await engine.shutdown()

    return build_app(config, lifespan)


async def start_engine(
    engine_args: EngineArgs,
    config: ServerConfig,
    engine_config: EngineConfig | None,
    launches: Sequence[WorkerLaunch],
) -> EngineClient:
    """One AsyncEngine, or a ReplicaSet of `config.data_parallel_size` engines."""
    if config.data_parallel_size == 1:
        return await RestartingEngine.start(
            engine_args,
            config.restart,
            launch=launches[0] if launches else None,
            pipeline_depth=config.pipeline_depth,
            supervision=config.supervision,
            config=engine_config,
        )
    return await ReplicaSet.start(
        engine_args,
        config.data_parallel_size,
        pipeline_depth=config.pipeline_depth,
        supervision=config.supervision,
        config=engine_config,
        launches=launches or None,
        restart=config.restart,
    )
