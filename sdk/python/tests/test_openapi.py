"""The gateway's OpenAPI document, against a standard validator, the live API and the SDK.

- The document is valid OpenAPI 3.1 (`openapi-spec-validator`).
- Every operation it lists is routed (the gateway's own unit test checks the other way: no
  route is registered outside the document).
- Real answers of an episode, successes and errors, match the schemas the document gives for
  their status.
- The SDK's models have exactly the fields of the schemas they read.
"""

import dataclasses
import os
import re

import httpx
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

import sandpool

URL = os.environ["SANDPOOL_URL"].rstrip("/")
TOKEN = os.environ["SANDPOOL_TOKEN"]
TEMPLATE = os.environ.get("SANDPOOL_TEMPLATE", "bb")


@pytest.fixture(scope="module")
def doc():
    r = httpx.get(f"{URL}/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def test_the_document_is_valid_openapi_3_1(doc):
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_docs_page_renders_the_document():
    r = httpx.get(f"{URL}/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'fetch("/openapi.json")' in r.text and "<script" in r.text
    assert "http://" not in r.text and "https://" not in r.text, "the page loads nothing from elsewhere"


def test_every_documented_operation_is_routed(doc):
    """Unauthenticated, a routed operation answers 401 (or its own answer); an unrouted one
    the router's 404 `no such route` or 405."""
    for path, item in doc["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        for method in item:
            r = httpx.request(method.upper(), f"{URL}{concrete}")
            assert r.status_code != 405, f"{method} {path}: 405"
            if r.status_code == 404:
                assert r.json()["message"] != "no such route", f"{method} {path} is not routed"


def _pointer(*parts):
    return "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)


class Checker:
    """Validates answers against the document's schema for their operation and status."""

    def __init__(self, doc):
        self.doc = doc
        self.registry = Registry().with_resource("urn:sandpool", Resource.from_contents(doc, DRAFT202012))
        self.http = httpx.Client(base_url=URL, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60)
        self.seen = set()

    def call(self, method, template, *, token=True, **kw):
        """`template` is the documented path; `kw["path"]` the concrete one (else the same)."""
        concrete = kw.pop("path", template)
        headers = None if token else {"authorization": ""}
        r = self.http.request(method, concrete, headers=headers, **kw)
        responses = self.doc["paths"][template][method.lower()]["responses"]
        status = str(r.status_code)
        assert status in responses, f"{method} {template} answered {status}, undocumented: {r.text[:300]}"
        content = responses[status].get("content", {})
        if "application/json" in content:
            ref = "urn:sandpool#/" + _pointer("paths", template, method.lower(), "responses", status, "content",
                                              "application/json", "schema")
            Draft202012Validator({"$ref": ref}, registry=self.registry).validate(r.json())
        else:
            assert not r.content or r.headers.get("content-type") in content, (method, template, status)
        self.seen.add((method, template, status))
        return r


def test_answers_match_their_schemas(doc):
    c = Checker(doc)
    c.call("GET", "/v1/templates")
    c.call("GET", "/v1/usage")
    c.call("GET", "/v1/usage", token=False)  # 401
    c.call("POST", "/v1/sessions", json={"template": "no-such-template"})  # 400 unknown_template
    c.call("POST", "/v1/sessions", json={"template": TEMPLATE, "bogus": 1})  # 400 unknown field
    s = c.call("POST", "/v1/sessions", json={"template": TEMPLATE, "labels": {"job": "openapi"}, "max_wait_s": 60})
    sid = s.json()["session_id"]
    one = "/v1/sessions/{id}"
    try:
        c.call("GET", one, path=f"/v1/sessions/{sid}")
        c.call("GET", one, path="/v1/sessions/local.00ff")  # 404
        c.call("POST", one + "/exec", path=f"/v1/sessions/{sid}/exec", json={"cmd": "echo hi; exit 3"})
        c.call("POST", one + "/exec", path=f"/v1/sessions/{sid}/exec", json={"cmd": "true", "timeout_ms": 0})
        c.call("PUT", one + "/files/{path}", path=f"/v1/sessions/{sid}/files/d/a.txt", content=b"hello")
        c.call("GET", one + "/files/{path}", path=f"/v1/sessions/{sid}/files/d/a.txt")
        c.call("GET", one + "/files/{path}", path=f"/v1/sessions/{sid}/files/d/../../etc/passwd")  # 400
        listing = c.call("GET", one + "/dirs/{path}", path=f"/v1/sessions/{sid}/dirs/d").json()
        assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [("a.txt", "file", 5)]
        c.call("GET", one + "/dirs/{path}", path=f"/v1/sessions/{sid}/dirs/d/a.txt")  # 400: not a directory
        c.call("GET", one + "/dirs/{path}", path=f"/v1/sessions/{sid}/dirs//nonexistent")  # 404
        c.call("POST", one + "/shells", path=f"/v1/sessions/{sid}/shells", json={"name": "sh1"})
        c.call("POST", one + "/shells/{name}/run", path=f"/v1/sessions/{sid}/shells/sh1/run", json={"cmd": "cd /tmp"})
        c.call("GET", one + "/shells", path=f"/v1/sessions/{sid}/shells")
        c.call("POST", one + "/shells/{name}/interrupt", path=f"/v1/sessions/{sid}/shells/sh1/interrupt")
        c.call("DELETE", one + "/shells/{name}", path=f"/v1/sessions/{sid}/shells/sh1")
        c.call("POST", one + "/keepalive", path=f"/v1/sessions/{sid}/keepalive")
        c.call("POST", one + "/pause", path=f"/v1/sessions/{sid}/pause")
        c.call("POST", one + "/resume", path=f"/v1/sessions/{sid}/resume")
        c.call("POST", "/v1/sessions:pause", json={"labels": {"job": "openapi"}})
        c.call("POST", "/v1/sessions:resume", json={"labels": {"job": "openapi"}})
        c.call("GET", "/v1/sessions", params={"label": "job=openapi"})
        c.call("GET", "/v1/pools")  # 403: not an admin
    finally:
        c.call("DELETE", one, path=f"/v1/sessions/{sid}")
    c.call("GET", one, path=f"/v1/sessions/{sid}")  # 404 session_gone
    statuses = {s for _, _, s in c.seen}
    assert {"200", "201", "204", "400", "401", "403", "404"} <= statuses, statuses


# Each SDK model and the schema it reads; the fields the SDK adds or leaves out on purpose.
MODELS = [
    (sandpool.SessionInfo, "Session", set(), set()),
    (sandpool.CommandResult, "ExecResponse", set(), {"encoding"}),  # the SDK always asks for utf8
    (sandpool.ShellResult, "ShellResult", set(), set()),
    (sandpool.ShellInfo, "ShellInfo", set(), set()),
    (sandpool.EntryInfo, "DirEntry", {"path"}, set()),  # `path`: the listing's directory + name
]


@pytest.mark.parametrize("model,schema,added,left_out", MODELS, ids=[m[1] for m in MODELS])
def test_sdk_models_have_the_schemas_fields(doc, model, schema, added, left_out):
    props = set(doc["components"]["schemas"][schema]["properties"])
    fields = {f.name for f in dataclasses.fields(model)}
    assert fields - added == props - left_out, f"{model.__name__} vs {schema}"
