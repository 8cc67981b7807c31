"""The HTTPS server (aiohttp): `/mutate` and `/validate` answer AdmissionReviews with the
policy's verdict, `/healthz` and `/readyz` the kubelet's probes, `/metrics` Prometheus.
Every bad body gets an answer (HTTP 400 or 413 when there is no review to answer, a
refusal in the review otherwise); nothing a client sends stops the server."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from . import review
from .metrics import CONTENT_TYPE, Metrics
from .policy import Policy, Verdict, admit
from .tls import ReloadingCertificate

log = logging.getLogger("podvm.webhook")

MAX_BODY = 3 << 20
"""A Pod is at most ~1.5 MiB (etcd's object limit); its review adds little more."""
POLICY, METRICS = web.AppKey("policy", Policy), web.AppKey("metrics", Metrics)
STOPPING = web.AppKey("stopping", asyncio.Event)
SHUTDOWN_GRACE = 1.0
"""Seconds a request in flight gets after SIGTERM: an answer takes milliseconds, so only a
stalled client (a body half sent, a reader that does not read) is still there by then;
aiohttp waits at most twice this (before and after cancelling the handler)."""


def make_app(policy: Policy, metrics: Metrics) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[POLICY], app[METRICS] = policy, metrics
    app.router.add_post("/mutate", _mutate)
    app.router.add_post("/validate", _validate)
    app.router.add_get("/healthz", _ok)
    app.router.add_get("/readyz", _ready)
    app.router.add_get("/metrics", _metrics)
    return app


async def _mutate(request: web.Request) -> web.Response:
    return await _admission(request, "mutate")


async def _validate(request: web.Request) -> web.Response:
    return await _admission(request, "validate")


async def _admission(request: web.Request, endpoint: str) -> web.Response:
    metrics = request.app[METRICS]
    started = time.perf_counter()
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        metrics.observe(endpoint, "invalid", time.perf_counter() - started)
        raise
    try:
        req = review.read_request(body)
    except review.BadReview as exc:
        metrics.observe(endpoint, "invalid", time.perf_counter() - started)
        log.info("bad admission request", extra={"fields": {"endpoint": endpoint,
                                                             "error": str(exc)}})
        return web.Response(status=400, text=str(exc) + "\n")
    verdict_name, answer = _answer(req, request.app[POLICY], endpoint)
    response = web.json_response(answer)
    metrics.observe(endpoint, verdict_name, time.perf_counter() - started)
    return response


def _answer(req: review.Request, policy: Policy, endpoint: str) -> tuple[str, dict]:
    if not review.is_pod(req):
        return "invalid", review.refused(
            req.uid, 400, f"podvm-webhook admits v1 Pods only, got {dict(req.kind)}: scope "
                          f"the webhook configuration's rules to pods")
    if req.operation != "CREATE":
        return "ignored", review.allowed(req.uid)  # a pod's size is set when it is created
    verdict = admit(req.object, policy)
    if not verdict.podvm:
        return "ignored", review.allowed(req.uid)
    if not verdict.allowed:
        log.info("pod refused", extra={"fields": {"endpoint": endpoint, "uid": req.uid,
                                                  "reason": verdict.message}})
        return "refused", review.refused(req.uid, verdict.code, _refusal(verdict),
                                         verdict.warnings)
    if endpoint == "mutate" and verdict.annotations:
        return "patched", review.allowed(
            req.uid, review.annotation_patch(req.object, verdict.annotations), verdict.warnings)
    return "allowed", review.allowed(req.uid, warnings=verdict.warnings)


def _refusal(verdict: Verdict) -> str:
    return f"podvm ({verdict.mode} sizing) refuses this pod: {verdict.message}"


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _ready(request: web.Request) -> web.Response:
    stopping = request.app.get(STOPPING)
    if stopping is not None and stopping.is_set():
        return web.Response(status=503, text="stopping\n")
    return web.Response(text="ok\n")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def serve(policy: Policy, cert: ReloadingCertificate, metrics: Metrics, host: str,
                port: int, reload_interval: float, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (SIGTERM), then close the listening socket at once (new
    connections are refused: not ready), close the idle keep-alive connections the API
    server holds, give requests in flight SHUTDOWN_GRACE, and cut off what is left, so
    that the process exits within seconds whatever its clients hold open."""
    app = make_app(policy, metrics)
    app[STOPPING] = stop
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE)
    await runner.setup()
    watch = asyncio.ensure_future(cert.watch(reload_interval))
    try:
        site = web.TCPSite(runner, host, port, ssl_context=cert.listening, backlog=1024)
        await site.start()
        log.info("serving", extra={"fields": {"address": f"{host}:{port}"}})
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait((watch, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if watch.done():
            watch.result()  # the watcher failed: its error ends the server
        log.info("stopping", extra={"fields": {"grace": SHUTDOWN_GRACE}})
    finally:
        watch.cancel()
        await runner.cleanup()
