"""HTTP API of the sim worker, in SGLang's shapes (aiohttp).

Routes (main port): ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` (streaming and
not), ``/health``, ``/health_generate``, ``/get_server_info`` (+ ``/server_info``, which the
router reads), ``/get_model_info`` (+ ``/model_info``), ``/v1/models``, ``/metrics``,
``/flush_cache``; sim admin ``GET|POST /sim/fault`` and ``GET /sim/stats``; PD internals
``/sim/kv/done`` and ``/sim/kv/write`` (decode). A prefill worker also serves its bootstrap
endpoints (``/sim/kv/dest``, ``/sim/kv/abort``) on ``--disaggregation-bootstrap-port``.

Every response carries the header ``X-Simulated-Engine`` and every JSON body a ``simulated``
flag (``metadata`` for OpenAI shapes, ``meta_info`` for ``/generate``). A streaming request
whose first event is an error (KV transfer timeout, early guard trip) gets a plain HTTP error
status instead of a stream, so the router can still retry it. With ``--api-key`` or
``--admin-api-key`` every request but ``/sim/*`` passes SGLang's own auth decision first
(:mod:`.auth`): ``/flush_cache`` then needs the admin key, as on a real engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cas_engine.adminkey import redact
from cas_engine.guard import error_body, http_response, sse_error_event
from cas_engine.kvfence.peer_probe import INCARNATION_HEADER
from cas_engine.sim import SIMULATOR_NOTICE, auth
from cas_engine.sim.config import SimConfig
from cas_engine.sim.pd import HttpTransport
from cas_engine.sim.textgen import join_pieces, tokenize
from cas_engine.sim.worker import Event, GenRequest, Run, SimWorker, new_rid

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


log = logging.getLogger("cas_engine.sim.server")

SIM_HEADER = {"X-Simulated-Engine": "cas_engine.sim"}
SIM_META = {"simulated": True, "engine": "cas_engine.sim"}
DEFAULT_MAX_TOKENS = 256


class _DropHttp2Probe(logging.Filter):
    """The SGLang router probes workers with HTTP/2 first; aiohttp logs each probe as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=dumps(obj),
        status=status,
        content_type="application/json",
        headers={**SIM_HEADER, **(headers or {})},
    )


def _error(status: int, message: str, etype: str = "sim_error") -> web.Response:
    return _json(
        {"error": {"message": message, "type": etype, "code": status}, "metadata": SIM_META},
        status=status,
    )


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """A trivial chat template: ``<|role|>`` then the text of each message."""
    parts = []
    for msg in messages:
        content = msg.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{msg.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _bootstrap(body: dict[str, Any]) -> tuple[str, int, int] | None:
    room = body.get("bootstrap_room")
    if room is None:
        return None
    if isinstance(room, list):
        raise web.HTTPBadRequest(text="batched requests are not simulated")
    return (
        str(body.get("bootstrap_host") or "127.0.0.1"),
        int(body.get("bootstrap_port") or 8998),
        int(room),
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimServer:
    """Routes of one worker; owns the aiohttp apps, delegates everything to the worker."""

    def __init__(self, cfg: SimConfig, worker: SimWorker) -> None:
        self.cfg = cfg
        self.worker = worker
        self.created = int(time.time())

    # ---- apps -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [self.sglang_auth] if self.cfg.api_key or self.cfg.admin_api_key else []
        app = web.Application(client_max_size=512 * 1024 * 1024, middlewares=middlewares)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/sim/fault", self.get_fault)
        r.add_post("/sim/fault", self.post_fault)
        r.add_get("/sim/stats", self.sim_stats)
        r.add_post("/sim/kv/done", self.kv_done)
        r.add_post("/sim/kv/write", self.kv_write)
        return app

    def bootstrap_app(self) -> web.Application:
        """The prefill's bootstrap server (decode workers register KV destinations here)."""
        app = web.Application()
        app.router.add_post("/sim/kv/dest", self.kv_dest)
        app.router.add_post("/sim/kv/abort", self.kv_abort)
        app.router.add_get("/health", self.bootstrap_health)
        return app

    @web.middleware
    async def sglang_auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """--api-key / --admin-api-key as SGLang applies them (`sim.auth`); /sim/* stays open."""
        if not request.path.startswith("/sim/"):
            allowed, refused = auth.decide(
                request.method,
                request.path,
                request.headers.get("Authorization"),
                self.cfg.api_key,
                self.cfg.admin_api_key,
            )
            if not allowed:
                text = "Unauthorized" if refused == 401 else "Forbidden"
                return _json({"error": text}, status=refused)
        return await handler(request)

    # ---- generation endpoints ---------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body.get("text")
        if isinstance(text, list) or (
            isinstance(body.get("input_ids"), list)
            and body["input_ids"]
            and isinstance(body["input_ids"][0], list)
        ):
            return _error(400, "batched /generate is not simulated")
        if text is None and body.get("input_ids") is not None:
            text = " ".join(str(t) for t in body["input_ids"])
        sp = body.get("sampling_params") or {}
        greq = self._gen_request(body, text or "", sp.get("max_new_tokens"), sp.get("seed"), "gen")
        run = self.worker.submit(greq)
        if body.get("stream"):
            return await self._stream(request, run, _GenerateShape(self, run))
        return await self._complete(run, _GenerateShape(self, run))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return _error(400, "batched prompts are not simulated")
            prompt = prompt[0]
        greq = self._gen_request(body, prompt, body.get("max_tokens"), body.get("seed"), "cmpl")
        run = self.worker.submit(greq)
        shape = _OpenAIShape(self, run, body, chat=False)
        if body.get("stream"):
            return await self._stream(request, run, shape)
        return await self._complete(run, shape)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = chat_prompt(body.get("messages") or [])
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        greq = self._gen_request(body, prompt, max_tokens, body.get("seed"), "chatcmpl")
        run = self.worker.submit(greq)
        shape = _OpenAIShape(self, run, body, chat=True)
        if body.get("stream"):
            return await self._stream(request, run, shape)
        return await self._complete(run, shape)

    def _gen_request(
        self, body: dict[str, Any], text: str, max_tokens: Any, seed: Any, prefix: str
    ) -> GenRequest:
        max_new = int(max_tokens) if max_tokens is not None else DEFAULT_MAX_TOKENS
        return GenRequest(
            rid=str(body.get("rid") or new_rid(prefix)),
            tokens=tokenize(text),
            max_new_tokens=max(1, max_new),
            sampling_seed=None if seed is None else int(seed),
            bootstrap=_bootstrap(body),
        )

    async def _complete(self, run: Run, shape: _Shape) -> web.Response:
        pieces: list[str] = []
        while True:
            ev = await run.out.get()
            if ev.kind == "tokens":
                pieces.extend(ev.pieces)
                continue
            break
        if ev.kind == "trip":
            assert ev.trip is not None
            status, headers, payload = http_response(ev.trip)
            return web.Response(body=payload, status=status, headers={**headers, **SIM_HEADER})
        if ev.kind == "error":
            return _error(ev.status, ev.message)
        return _json(shape.full(join_pieces(pieces), ev.reason))

    async def _stream(self, request: web.Request, run: Run, shape: _Shape) -> web.StreamResponse:
        first = await run.out.get()
        if first.kind in ("trip", "error"):  # nothing sent yet: a plain error the router retries
            return await self._complete_first(first)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **SIM_HEADER}
        )
        await resp.prepare(request)
        ev: Event | None = first
        try:
            await resp.write(shape.start())
            while ev is not None:
                if ev.kind == "tokens":
                    await resp.write(shape.delta(ev.pieces))
                    ev = run.out.get_nowait() if not run.out.empty() else await run.out.get()
                    continue
                await resp.write(self._stream_end(ev, shape))
                ev = None
        except (ConnectionResetError, asyncio.CancelledError):
            self.worker.cancel(run)
            raise
        return resp

    async def _complete_first(self, ev: Event) -> web.Response:
        if ev.kind == "trip":
            assert ev.trip is not None
            status, headers, payload = http_response(ev.trip)
            return web.Response(body=payload, status=status, headers={**headers, **SIM_HEADER})
        return _error(ev.status, ev.message)

    @staticmethod
    def _stream_end(ev: Event, shape: _Shape) -> bytes:
        if ev.kind == "trip":
            assert ev.trip is not None
            return sse_error_event(ev.trip)
        if ev.kind == "error":
            err = {"error": {"message": ev.message, "type": "sim_error", "code": ev.status}}
            return b"data: " + dumps(err) + b"\n\ndata: [DONE]\n\n"
        return shape.end(ev.reason)

    # ---- info, health, metrics ----------------------------------------------------------------

    async def _wait_not_hung(self) -> None:
        for _ in range(12000):  # the hang fault: stay silent (bounded at 10 minutes)
            if not self.worker.faults.hang:
                return
            await asyncio.sleep(0.05)

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's /health: a one-token generation, answered once the scheduler replies, which
        it first looks for after a second (http_server.py:777-781): `health_delay_s`."""
        response = await self.bootstrap_health(request)
        if self.cfg.health_delay_s:
            await asyncio.sleep(self.cfg.health_delay_s)
        return response

    async def bootstrap_health(self, request: web.Request) -> web.Response:
        """The prefill bootstrap server's /health: answers at once (the decode's heartbeat)."""
        await self._wait_not_hung()
        return web.Response(
            text="", headers={**SIM_HEADER, INCARNATION_HEADER: self.worker.incarnation}
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/server_info` shape (http_server.py:863-893): the launch settings (the
        keys among them, as SGLang's `build_server_info` has them), `launch_command`, and
        per scheduler its internal state (the settings again); redacted by the engine
        layer's one rule (`cas_engine.adminkey.redact`), as the launcher has SGLang do."""
        c = self.cfg
        settings = {
            "model_path": c.model_path,
            "served_model_name": c.model_name,
            "tp_size": c.tp_size,
            "disaggregation_mode": c.mode,
            "disaggregation_bootstrap_port": c.bootstrap_port,
            "max_running_requests": c.max_running_requests,
            "context_length": c.context_length,
            "speculative_num_steps": c.spec_num_steps,
            "api_key": c.api_key or None,
            "admin_api_key": c.admin_api_key or None,
        }
        state = {
            **settings,
            "last_gen_throughput": self.worker.gen_rate,
            "avg_spec_accept_length": self.worker.avg_accept_length,
        }
        info = {
            **settings,
            "launch_command": c.launch_command,
            "version": "sim",
            "internal_states": [state],
            "sim": self.worker.snapshot(),
            "sim_notice": SIMULATOR_NOTICE,
            **SIM_META,
        }
        return _json(redact(info))

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "sim",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "sim",
                "architectures": ["SimulatedGlmMoeDsaForCausalLM"],
                **SIM_META,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "sglang",
                        "root": self.cfg.model_path,
                        "max_model_len": self.cfg.context_length,
                        "metadata": SIM_META,
                    }
                ],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        self.worker._refresh_gauges()
        return web.Response(
            body=generate_latest(self.worker.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST, **SIM_HEADER},
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        w = self.worker
        w.cache = type(w.cache)(self.cfg.timing.block_size, self.cfg.timing.kv_capacity_tokens)
        return web.Response(text="Cache flushed.", headers=SIM_HEADER)

    # ---- sim admin and PD internals -----------------------------------------------------------

    async def get_fault(self, request: web.Request) -> web.Response:
        return _json({"faults": self.worker.faults.as_dict(), **SIM_META})

    async def post_fault(self, request: web.Request) -> web.Response:
        """Change faults live: a JSON object (``{"corruption": 0.1}``) or a spec string."""
        raw = await request.text()
        try:
            spec: Any = json.loads(raw) if raw.strip().startswith("{") else raw
            self.worker.faults.apply(spec)
        except ValueError as exc:
            return _error(400, str(exc))
        log.warning("sim faults now %s", self.worker.faults.as_dict())
        if self.worker.faults.crash:
            asyncio.get_running_loop().call_later(0.05, os._exit, 70)
        return _json({"faults": self.worker.faults.as_dict(), **SIM_META})

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json({"stats": self.worker.snapshot(), **SIM_META})

    async def kv_done(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.worker.decode_kv is None:
            return _error(400, "not a decode worker")
        self.worker.decode_kv.on_done(
            int(body["room"]),
            int(body["generation"]),
            bool(body["ok"]),
            int(body.get("cached_tokens", 0)),
        )
        return _json({"ok": True})

    async def kv_write(self, request: web.Request) -> web.Response:
        kv = self.worker.decode_kv
        if kv is None or not isinstance(kv.transport, HttpTransport):
            return _error(400, "HTTP KV writes are not enabled on this worker")
        kv.transport.local_write(int(request.headers["X-Sim-Addr"]), await request.read())
        return _json({"ok": True})

    async def kv_dest(self, request: web.Request) -> web.Response:
        if self.worker.prefill_kv is None:
            return _error(400, "not a prefill worker")
        body = await request.json()
        # the decode's ledger tracks the room under a rank bound to one incarnation: another
        # process (this one, restarted) must not take the room; the decode learns it from 409
        answer = {
            "ok": True,
            "incarnation": self.worker.incarnation,
            "session": self.worker.prefill_kv.transport.session_id,
        }
        expected = body.get("incarnation")
        if expected is not None and expected != self.worker.incarnation:
            return _json({**answer, "ok": False}, status=409)
        self.worker.prefill_kv.on_dest(body)
        return _json(answer)  # its endpoints: what the decode probes once it declares us dead

    async def kv_abort(self, request: web.Request) -> web.Response:
        if self.worker.prefill_kv is None:
            return _error(400, "not a prefill worker")
        ack = await self.worker.prefill_kv.on_abort(await request.json(), timeout=50.0)
        return _json(
            {"ack": None if ack is None else ack.to_dict(), "incarnation": self.worker.incarnation}
        )


class _Shape:
    """Response shape of one endpoint: the full body, or the stream's start/delta/end bytes."""

    def full(self, text: str, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> bytes:
        return b""

    def delta(self, pieces: tuple[str, ...]) -> bytes:
        raise NotImplementedError

    def end(self, reason: str) -> bytes:
        raise NotImplementedError


def _sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class _GenerateShape(_Shape):
    """SGLang ``/generate``: ``text`` (cumulative when streaming) + ``meta_info``."""

    def __init__(self, server: SimServer, run: Run) -> None:
        self.run = run
        self.text: list[str] = []

    def _meta(self, reason: str | None) -> dict[str, Any]:
        meta = self.run.meta_info()
        meta["finish_reason"] = (
            None if reason is None else {"type": reason, "length": self.run.generated}
        )
        return meta

    def full(self, text: str, reason: str) -> dict[str, Any]:
        return {"text": text, "meta_info": self._meta(reason)}

    def delta(self, pieces: tuple[str, ...]) -> bytes:
        self.text.append(join_pieces(list(pieces)))
        return _sse({"text": "".join(self.text), "meta_info": self._meta(None)})

    def end(self, reason: str) -> bytes:
        return (
            _sse({"text": "".join(self.text), "meta_info": self._meta(reason)})
            + b"data: [DONE]\n\n"
        )


class _OpenAIShape(_Shape):
    """OpenAI chat/text completions, with ``metadata`` marking the simulator."""

    def __init__(self, server: SimServer, run: Run, body: dict[str, Any], *, chat: bool) -> None:
        self.run = run
        self.chat = chat
        self.host = server.cfg.host
        self.model = body.get("model") or server.cfg.model_name
        self.created = int(time.time())
        self.id = run.req.rid
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        self._obj = "chat.completion" if chat else "text_completion"
        self._make_chunk: Callable[[str, str | None], dict[str, Any]] = (
            self._chat_chunk if chat else self._text_chunk
        )

    def _usage(self) -> dict[str, Any]:
        r = self.run
        prompt = len(r.req.tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": r.generated,
            "total_tokens": prompt + r.generated,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        }

    def _metadata(self) -> dict[str, Any]:
        meta = self.run.meta_info()
        out = {
            **SIM_META,
            "spec_verify_ct": meta["spec_verify_ct"],
            "spec_accept_length": meta["spec_accept_length"],
        }
        bootstrap = self.run.req.bootstrap
        if bootstrap is not None:  # which prefill fed this decode (tests check PD pairs)
            out["pd_pair"] = {"prefill": f"{bootstrap[0]}:{bootstrap[1]}", "decode": self.host}
        return out

    def full(self, text: str, reason: str) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": None,
        }
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": None,
            }
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": self._obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(),
            "metadata": self._metadata(),
        }

    def _chat_chunk(self, content: str, reason: str | None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {"content": content} if reason is None else {},
            "logprobs": None,
            "finish_reason": reason,
        }

    def _text_chunk(self, content: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        return _sse(
            {
                "id": self.id,
                "object": f"{self._obj}.chunk" if self.chat else self._obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                **extra,
            }
        )

    def start(self) -> bytes:
        if not self.chat:
            return b""
        return self._chunk(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            },
            metadata=SIM_META,
        )

    def delta(self, pieces: tuple[str, ...]) -> bytes:
        return self._chunk(self._make_chunk(join_pieces(list(pieces)), None))

    def end(self, reason: str) -> bytes:
        out = self._chunk(self._make_chunk("", reason), metadata=self._metadata())
        if self.include_usage:
            out += _sse(
                {
                    "id": self.id,
                    "object": f"{self._obj}.chunk" if self.chat else self._obj,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self._usage(),
                }
            )
        return out + b"data: [DONE]\n\n"


def install_log_filter() -> None:
    """Silence the router's HTTP/2 probes in aiohttp's server log."""
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())


__all__ = ["SimServer", "error_body", "install_log_filter"]
