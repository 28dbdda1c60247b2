"""The console's HTTP transport (Starlette): each page's address, its parameters checked, what
`Console` returns rendered as HTML, JSON or server-sent events; failures as pages (a service
down: 503, something that does not exist: 404, a bug: 500, never a traceback)."""

from __future__ import annotations

import contextlib
import hmac
import importlib.util
import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from services.console.errors import Busy, NotFound
from services.console.model_pages import version_row
from services.console.sources import Unavailable
from services.console.views import Console
from shared.client import ClientError
from shared.endpoints import parse_properties
from shared.logging import get_logger

HERE = Path(__file__).parent


def _plotly_js() -> Path:
    """plotly.min.js inside the plotly package, found without importing it (a slow import)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise RuntimeError("the plotly package is not installed")
    return Path(spec.origin).parent / "package_data" / "plotly.min.js"


PLOTLY_JS = _plotly_js()
TOKEN_COOKIE = "cogment_console_token"
STATES = ("running", "ended", "interrupted", "pending", "initializing", "terminating", "unknown")
# Trials on one comparison chart at most.
COMPARE_MAX = 10
LOGIN_FORM_BYTES = 4096

log = get_logger("console")
templates = Jinja2Templates(directory=str(HERE / "templates"))


class BadRequest(Exception):
    """A parameter of the address that cannot be used: a 400 page saying which."""


def _int(request: Request, name: str, default: int | None = None) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    if not text.isdecimal():
        raise BadRequest(f"{name} must be a non-negative integer, not [{text}]")
    return int(text)


def _page(request: Request, template: str, status_code: int = 200, **context: Any) -> Response:
    return templates.TemplateResponse(
        request, template, {"page": template.removesuffix(".html"), **context}, status_code=status_code
    )


def _handled(
    endpoint: Callable[[Request, Console], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint whose failures become pages: one mapping point for the whole console."""

    async def handle(request: Request) -> Response:
        console: Console = request.app.state.console
        try:
            return await endpoint(request, console)
        except NotFound as error:
            return _error(request, 404, "Not found", str(error))
        except BadRequest as error:
            return _error(request, 400, "Bad request", str(error))
        except Unavailable as error:
            return _error(request, 503, f"The {error.service.replace('_', ' ')} is unavailable", str(error))
        except Busy as error:
            return _error(request, 503, "Busy", str(error))
        except Exception:
            log.exception("console page failed", path=request.url.path)
            return _error(request, 500, "Internal error", "The console failed; its log says why.")

    return handle


def _error(request: Request, status: int, title: str, message: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": title, "message": message}, status_code=status)
    return _page(request, "error.html", status_code=status, title=title, message=message)


# ---- pages ----


async def overview(request: Request, console: Console) -> Response:
    return _page(request, "overview.html", overview=await console.overview())


async def trials(request: Request, console: Console) -> Response:
    states = set(request.query_params.getlist("state")) - {""}
    unknown = states - set(STATES)
    if unknown:
        raise BadRequest(f"unknown state [{', '.join(sorted(unknown))}]; states are {', '.join(STATES)}")
    properties_text = request.query_params.get("properties", "")
    try:
        properties = parse_properties(properties_text) if properties_text else {}
    except ValueError as error:
        raise BadRequest(f"properties: {error}") from None
    page = await console.trials(_int(request, "before"), states, properties)
    older = None
    if page.older is not None:
        query = [(key, value) for key, value in request.query_params.multi_items() if key != "before"]
        older = "?" + urllib.parse.urlencode([*query, ("before", str(page.older))])
    return _page(
        request,
        "trials.html",
        trials=page,
        states=STATES,
        selected_states=states,
        properties=properties_text,
        older=older,
    )


async def trial(request: Request, console: Console) -> Response:
    return _page(request, "trial.html", trial=await console.trial(request.path_params["trial_id"]))


async def tick(request: Request, console: Console) -> Response:
    view = await console.tick(request.path_params["trial_id"], request.path_params["tick"])
    return JSONResponse(asdict(view))


async def trial_curves(request: Request, console: Console) -> Response:
    """Server-sent snapshots of the trial's curves while its samples are read, then while it runs."""
    trial_id = request.path_params["trial_id"]
    await console.trial_info(trial_id)  # a 404 before the stream starts

    async def events() -> AsyncIterator[str]:
        try:
            # Closed with the response: the trial's read stops and its memory is given back.
            async with contextlib.aclosing(console.curve_snapshots(trial_id)) as snapshots:
                async for snapshot in snapshots:
                    yield f"data: {json.dumps(snapshot)}\n\n"
        except (Unavailable, Busy) as error:
            yield f"event: failure\ndata: {json.dumps(str(error))}\n\n"
        yield "event: end\ndata: {}\n\n"

    return _events(events())


async def compare(request: Request, console: Console) -> Response:
    trial_ids = [trial_id for trial_id in request.query_params.getlist("trial") if trial_id]
    if len(trial_ids) > COMPARE_MAX:
        raise BadRequest(f"at most {COMPARE_MAX} trials on one chart")
    series = []
    for trial_id in trial_ids:
        curves = await console.stored_curves(trial_id)
        series += [
            {"name": f"{trial_id} / {curve['actor']}", "ticks": curve["ticks"], "returns": curve["returns"]}
            for curve in curves
        ]
    return _page(request, "compare.html", trial_ids=trial_ids, series=series)


async def models(request: Request, console: Console) -> Response:
    return _page(request, "models.html", models=await console.models())


async def model(request: Request, console: Console) -> Response:
    model_id = request.path_params["model_id"]
    versions = await console.versions(model_id)
    return _page(request, "model.html", model_id=model_id, versions=versions)


async def version_data(request: Request, console: Console) -> Response:
    """The version's data, streamed from the registry and checked against its SHA-256 as it
    goes: a mismatch cuts the download, so the browser never keeps wrong bytes as complete."""
    model_id, number = request.path_params["model_id"], request.path_params["number"]
    info = await console.version(model_id, number)
    client = await console.sources.client("model_registry")

    async def chunks() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(client.version_chunks(info)) as stream:  # type: ignore[attr-defined]
            async for chunk in stream:
                yield chunk

    filename = f"{model_id}-v{number}.bin"
    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={
            "Content-Disposition": f"attachment; filename*=UTF-8''{urllib.parse.quote(filename)}",
            "Content-Length": str(info.data_size),
        },
    )


async def model_events(request: Request, console: Console) -> Response:
    model_id = request.path_params["model_id"]
    await console.versions(model_id)  # a 404 before the stream starts
    client = await console.sources.client("model_registry")

    async def events() -> AsyncIterator[str]:
        try:
            async for info in client.follow_versions(model_id):  # type: ignore[attr-defined]
                yield f"data: {json.dumps(asdict(version_row(info)))}\n\n"
        except (ClientError, grpc.aio.AioRpcError) as error:  # the registry went away: the page says so
            yield f"event: failure\ndata: {json.dumps(str(error))}\n\n"

    return _events(events())


async def directory(request: Request, console: Console) -> Response:
    return _page(request, "directory.html", entries=await console.entries())


def _events(stream: AsyncIterator[str]) -> Response:
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def healthz(request: Request) -> Response:
    """What a probe checks: the console answers. A service down is shown on the pages, so it does
    not make the console unready (nor restart it)."""
    return Response("ok\n", media_type="text/plain", headers={"Cache-Control": "no-store"})


async def plotly_js(request: Request) -> Response:
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})


# ---- access token ----


async def login(request: Request) -> Response:
    """The form where the access token is entered once; it is kept in a cookie."""
    target = request.query_params.get("next", "/")
    if not target.startswith("/") or target.startswith("//"):
        target = "/"
    if request.method == "POST":
        body = b""
        async for part in request.stream():  # a token, not an upload: read a few KiB at most
            body += part
            if len(body) > LOGIN_FORM_BYTES:
                return _error(request, 413, "Too large", "The login form takes a token only.")
        token = urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
        if _token_matches(request.app.state.auth_token, token):
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
            return response
        return _page(request, "login.html", status_code=401, next=target, wrong=True)
    return _page(request, "login.html", next=target, wrong=False)


def _token_matches(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())


class TokenRequired(BaseHTTPMiddleware):
    """With an access token configured: every page but the login form, the static files and the
    probes' /healthz needs it, as a bearer token or the login form's cookie."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        expected: str = request.app.state.auth_token
        path = request.url.path
        if not expected or path in ("/login", "/healthz") or path.startswith("/static/"):
            return await call_next(request)
        header = request.headers.get("authorization", "")
        given = (
            header.removeprefix("Bearer ")
            if header.startswith("Bearer ")
            else request.cookies.get(TOKEN_COOKIE, "")
        )
        if _token_matches(expected, given):
            return await call_next(request)
        if path.startswith("/api/") or "text/html" not in request.headers.get("accept", ""):
            return JSONResponse({"error": "an access token is required"}, status_code=401)
        return RedirectResponse(
            f"/login?{urllib.parse.urlencode({'next': str(request.url.path)})}", status_code=303
        )


async def _no_route(request: Request, error: Exception) -> Response:
    return _error(request, 404, "Not found", f"Nothing is served at [{request.url.path}].")


def build_app(console: Console, auth_token: str) -> Starlette:
    routes = [
        Route("/", _handled(overview)),
        Route("/trials", _handled(trials)),
        Route("/trials/{trial_id}", _handled(trial)),
        Route("/api/trials/{trial_id}/ticks/{tick:int}", _handled(tick)),
        Route("/api/trials/{trial_id}/curves", _handled(trial_curves)),
        Route("/compare", _handled(compare)),
        Route("/models", _handled(models)),
        Route("/models/{model_id}", _handled(model)),
        Route("/models/{model_id}/versions/{number:int}/data", _handled(version_data)),
        Route("/api/models/{model_id}/events", _handled(model_events)),
        Route("/directory", _handled(directory)),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/healthz", healthz),
        Route("/static/vendor/plotly.min.js", plotly_js),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(TokenRequired)],
        exception_handlers={404: _no_route, 405: _no_route},
    )
    app.state.console = console
    app.state.auth_token = auth_token
    return app
