"""The HTTP side: Starlette routes, one worker thread that generates, and SSE streaming.

One model serves one request at a time, in arrival order. Generation is torch work that holds
the cores, so it runs on a single worker thread (a one-thread executor runs its jobs first in,
first out) while the event loop keeps answering: it checks and renders each request, queues it,
and relays the worker's text to the client. The worker hands text over through an asyncio
queue, one item per round (`loop.call_soon_threadsafe`).

A streaming client that goes away: Starlette cancels the response's generator, which sets the
job's `cancelled` flag; the worker's streamer callback sees it at the next round and raises,
and Session puts the turn back as if it had never been sent (cache, drafter and tokens), so the
next request's output is what a fresh run gives.

Streaming uses Starlette's own StreamingResponse with SSE's `data: ...` framing written here:
the framing is two lines, and StreamingResponse already cancels the body when the client
disconnects, which is the part that matters; no further dependency is needed for it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specfast.constraints import check_response_format
from specfast.serve.logprobs import Logprobs, Relay, options, whole
from specfast.serve.pool import Pool
from specfast.serve.protocol import BadRequest, Request, error_body, parse_request
from specfast.serve.replies import chunk, completion, usage_chunk
from specfast.serve.stops import StopHold, cut_at_stop
from specfast.serve.tool_calls import CallStream, reply
from specfast.serve.tools import ToolsError, constrain, render
from specfast.settings import encode_text
from specfast.targets import as_target
from specfast.targets.base import common_prefix


class Disconnected(Exception):
    """Raised inside a generation whose client went away; Session drops the turn."""


@dataclass(eq=False)  # compared and hashed by identity: the server keeps a set of them
class Job:
    req: Request
    ids: list[int]
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    on_end: Any = None  # called on the event loop before the last event is delivered
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: bool = False

    def put(self, kind: str, value: Any = None) -> None:
        """From the worker thread: hand text to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def end(self, kind: str, value: Any = None) -> None:
        """From the worker thread: the last event ("done", "error" or "cancelled"). The server
        counts the job out before its client hears of it, so a client's next request never
        finds this one still in the queue."""
        self.ended = True
        self.loop.call_soon_threadsafe(self._deliver, kind, value)

    def _deliver(self, kind: str, value: Any) -> None:
        if self.on_end is not None:
            self.on_end(self)
        self.events.put_nowait((kind, value))


@dataclass
class Server:
    """What the routes share. `queue`: how many requests may wait behind the running one."""

    model: Any
    model_id: str
    pool: Pool
    queue: int = 16
    save_every: int = 8
    defaults: dict = field(default_factory=lambda: {"drafter": "ngram", "k": "auto"})
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="specfast-generate")
    )
    in_flight: int = 0  # queued or running; touched only on the event loop
    served: int = 0
    cancelled: int = 0
    jobs: set = field(default_factory=set)

    def __post_init__(self):
        self.target = as_target(self.model)
        self.tokenizer = self.target.tokenizer
        self.vocab_size = self.target.vocab_size

    # ------------------------------------------------------------------ on the event loop

    def prompt_ids(self, req: Request) -> list[int]:
        """The request's rendered prompt, as generate() renders it for the same input."""
        if req.kind == "chat":
            text = render(req.prompt, req.tools, self.target.chat_template)
            ids = encode_text(self.tokenizer, text)
        elif isinstance(req.prompt, str):
            ids = encode_text(self.tokenizer, req.prompt)
        else:
            ids = req.prompt
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        field_name = "messages" if req.kind == "chat" else "prompt"
        if not ids:
            raise BadRequest(f"{field_name} renders to no tokens", field_name)
        return ids

    def check_format(self, req: Request) -> None:
        """A 400 naming response_format (tools) when its grammar does not compile for this
        model. A request whose tools may be called gets their grammar here (tools.py)."""
        eos = set(self.target.eos_token_ids)
        try:
            constrain(req, self.tokenizer, self.vocab_size, eos)
            if req.response_format is not None:
                check_response_format(req.response_format, self.tokenizer, self.vocab_size, eos)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e), "tools" if req.tools else "response_format") from None

    def budget(self, req: Request, n_prompt: int) -> int:
        """max_new_tokens for the request; a 400 when the prompt and max_tokens do not fit."""
        room = self.pool.max_length - n_prompt
        if req.max_tokens is None:
            if room < 1:
                where = "messages" if req.kind == "chat" else "prompt"
                raise BadRequest(
                    f"the prompt ({n_prompt} tokens) fills the context of "
                    f"{self.pool.max_length} tokens; shorten it",
                    where,
                )
            return room
        if req.max_tokens > room:
            raise BadRequest(
                f"max_tokens must be at most {max(room, 0)} here: the prompt is {n_prompt} tokens "
                f"and the context {self.pool.max_length} (--max-length)",
                "max_tokens",
            )
        return req.max_tokens

    def submit(self, job: Job) -> None:
        if self.in_flight > self.queue:
            raise BadRequest(
                f"the server is busy: {self.in_flight} requests ahead (--queue {self.queue}); "
                "retry later",
                status=429,
            )
        self.in_flight += 1
        self.jobs.add(job)
        job.on_end = self.done
        future = self.executor.submit(self.generate, job)
        future.add_done_callback(lambda _: None if job.ended else job.end("cancelled"))  # never ran

    def done(self, job: Job) -> None:
        self.in_flight -= 1
        self.jobs.discard(job)

    # ------------------------------------------------------------------ on the worker thread

    def generate(self, job: Job) -> None:
        """Serves one job: picks its Session, generates, streams text, feeds the corpus."""
        if job.cancelled.is_set():
            job.end("cancelled")
            return
        req = job.req
        try:
            session = self.pool.session_for(job.ids, req.drafter, req.k)
            keep = common_prefix(job.ids, session.token_ids)
            out = session.send_context(
                job.ids,
                max_new_tokens=job.max_new_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop_strings=req.stop or None,
                streamer=self.streamer(job) if req.stream else None,
                response_format=req.response_format,
                **options(req.logprobs),
            )
        except Disconnected:
            self.cancelled += 1
            job.end("cancelled")
            return
        except Exception as e:  # a bad request the checks let through; the server goes on
            job.end("error", e)
            return
        self.served += 1
        try:
            self.pool.finished(job.ids[keep:] + out.token_ids, self.save_every)
        except (OSError, ValueError) as e:  # the server's problem, not this reply's
            print(f"specfast serve: could not write the corpus: {e}", file=sys.stderr)
        job.end("done", out)

    def streamer(self, job: Job):
        """Called once a round with the new text: relays it, or stops a cancelled job."""

        def put(text: str) -> None:
            if job.cancelled.is_set():
                raise Disconnected
            if text:
                job.put("text", text)

        return put if job.req.logprobs is None else Relay(put, job)

    def shutdown(self) -> None:
        """Stops what runs, waits for the worker, then writes the corpus."""
        for job in list(self.jobs):
            job.cancelled.set()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.pool.save()


# ----------------------------------------------------------------------------
# routes


class EventStream(StreamingResponse):
    """An SSE response that cancels its job however it ends: finished, or the client gone
    (Starlette cancels the body when it hears the disconnect, or a send fails after it)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def error(e: BadRequest | ToolsError) -> JSONResponse:
    kind = "rate_limit_exceeded" if e.status == 429 else "invalid_request_error"
    return JSONResponse(error_body(str(e), e.param, kind), status_code=e.status)


async def read_json(request: HTTPRequest) -> Any:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def build_app(server: Server) -> Starlette:
    async def completions(request: HTTPRequest, kind: str):
        try:
            req = parse_request(await read_json(request), kind, server.model_id, server.defaults)
            ids = server.prompt_ids(req)
            server.check_format(req)
            job = Job(req, ids, server.budget(req, len(ids)), asyncio.get_running_loop())
            server.submit(job)
        except (BadRequest, ToolsError) as e:
            return error(e)
        if req.stream:
            return EventStream(stream(job), job)
        kind_, value = await job.events.get()
        if kind_ == "error":
            return error(BadRequest(str(value)))
        if kind_ != "done":
            return error(BadRequest("the request was cancelled", status=503))
        text = cut_at_stop(value.text or "", req.stop)
        n_new = len(value.token_ids)
        logprobs = whole(req, server.target, value, text)
        body = completion(req, text, value.finish_reason, len(ids), n_new, value.stats, logprobs)
        return JSONResponse(reply(req, body, text, value.finish_reason))

    async def stream(job: Job):
        req = job.req
        hold, out = StopHold(req.stop), CallStream(req, chunk)  # text, or tool-call deltas
        logprobs = Logprobs(req.kind, req.logprobs, server.target)

        def sent(chunks: list[dict]) -> list[dict]:
            # The first chunk of a delta carries the logprobs of the text sent so far; with no
            # chunk (a call still being parsed) they wait for the next one.
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = logprobs.take(hold.sent)
            return chunks

        try:
            yield sse(chunk(req, first=True))
            while True:
                kind, value = await job.events.get()
                if kind == "logprobs":
                    logprobs.add(*value)
                    continue
                if kind == "text":
                    for c in sent(out.chunks(hold.add(value))):
                        yield sse(c)
                    continue
                if kind == "done":
                    text = hold.rest(cut_at_stop(value.text or "", req.stop))
                    for c in sent(out.chunks(text, end=True)):
                        yield sse(c)
                    yield sse(out.last(value.finish_reason))
                    if req.include_usage:
                        n = len(value.token_ids)
                        yield sse(usage_chunk(req, len(job.ids), n, value.stats))
                elif kind == "error":
                    yield sse(error_body(str(value)))
                yield sse("[DONE]")
                return
        finally:
            job.cancelled.set()  # the client went away, or it is over: either way, stop

    async def chat_route(request: HTTPRequest):
        return await completions(request, "chat")

    async def completion_route(request: HTTPRequest):
        return await completions(request, "completion")

    async def models(request: HTTPRequest):
        entry = {"id": server.model_id, "object": "model", "created": 0, "owned_by": "specfast"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: HTTPRequest):
        corpus = server.pool.corpus
        return JSONResponse(
            {
                "status": "ok",
                "model": server.model_id,
                "sessions": len(server.pool),
                "in_flight": server.in_flight,
                "served": server.served,
                "cancelled": server.cancelled,
                "corpus_tokens": 0 if corpus is None else corpus.corpus_tokens,
            }
        )

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_route, methods=["POST"]),
            Route("/v1/completions", completion_route, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def run_server(server: Server, host: str, port: int, log_level: str = "warning") -> None:
    """Serves until SIGINT or SIGTERM; the corpus is written on the way out."""
    import uvicorn

    uvicorn.run(build_app(server), host=host, port=port, log_level=log_level)
