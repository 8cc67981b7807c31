"""admission.k8s.io/v1 AdmissionReview: the request the API server sends, the response it
expects (the same uid; a JSONPatch, base64, for a mutation; a Status for a refusal;
warnings). A body that is not a review is a BadReview, answered with HTTP 400: without a
uid there is no response the API server could match."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Mapping

API_VERSION = "admission.k8s.io/v1"
POD_KIND = {"group": "", "version": "v1", "kind": "Pod"}
_REASONS = {400: "BadRequest", 403: "Forbidden"}


class BadReview(ValueError):
    """The body is not an AdmissionReview request this server can answer."""


@dataclass(frozen=True)
class Request:
    uid: str
    kind: Mapping[str, Any]
    operation: str
    object: Any


def read_request(body: bytes) -> Request:
    try:
        review = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadReview(f"the body is not JSON: {exc}") from None
    if not isinstance(review, dict):
        raise BadReview("the body is not an AdmissionReview object")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != "AdmissionReview":
        raise BadReview(f"expected apiVersion {API_VERSION}, kind AdmissionReview; got "
                        f"apiVersion {review.get('apiVersion')!r}, kind {review.get('kind')!r}"
                        f" (set admissionReviewVersions: [v1] in the webhook configuration)")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("the AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("the AdmissionReview request has no uid")
    kind = request.get("kind")
    return Request(uid=uid, kind=kind if isinstance(kind, dict) else {},
                   operation=str(request.get("operation") or ""), object=request.get("object"))


def is_pod(request: Request) -> bool:
    return all(request.kind.get(k) == v for k, v in POD_KIND.items())


def allowed(uid: str, patch: list[dict] | None = None,
            warnings: tuple[str, ...] = ()) -> dict:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if warnings:
        response["warnings"] = list(warnings)
    return _review(response)


def refused(uid: str, code: int, message: str, warnings: tuple[str, ...] = ()) -> dict:
    response: dict[str, Any] = {
        "uid": uid, "allowed": False,
        "status": {"status": "Failure", "code": code, "reason": _REASONS.get(code, ""),
                   "message": message}}
    if warnings:
        response["warnings"] = list(warnings)
    return _review(response)


def _review(response: dict) -> dict:
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def annotation_patch(pod: dict, annotations: Mapping[str, str]) -> list[dict]:
    """JSONPatch (RFC 6902) operations adding `annotations` to the pod: the whole map when
    it has none, else one `add` per key, its `~` and `/` escaped (RFC 6901)."""
    if not annotations:
        return []
    if not (pod.get("metadata") or {}).get("annotations"):
        return [{"op": "add", "path": "/metadata/annotations", "value": dict(annotations)}]
    return [{"op": "add", "path": "/metadata/annotations/" + pointer_token(key), "value": value}
            for key, value in annotations.items()]


def pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
