"""
The middleware that refuses per-request aux-flow settings, in front of a route that reads requests as vLLM's
completions route does (its JSON check, which ignores the Content-Type's case, and its request model), registered as
vLLM registers a `--middleware` function: refused whatever the Content-Type's case, and for a JSON body whatever its
header says; other requests reach the route.
"""

import json

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import validate_json_request

from dualflow.serving.middleware import refuse_aux_fields


BODY = {"model": "m", "prompt": "w7 w8", "max_tokens": 1}


@pytest.fixture(scope="module")
def client():
    app = FastAPI()

    @app.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    async def create_completion(request: CompletionRequest):
        return {"prompt": request.prompt}

    app.middleware("http")(refuse_aux_fields)
    return TestClient(app)


def post(client, body, content_type):
    headers = {"content-type": content_type} if content_type else {}
    return client.post("/v1/completions", content=body, headers=headers)


@pytest.mark.parametrize(
    "content_type", ["application/json", "Application/JSON; charset=utf-8", "APPLICATION/JSON", "text/plain", None]
)
@pytest.mark.parametrize("field", [{"use_aux_flow": False}, {"aux_num_experts_per_tok": 8}])
def test_aux_fields_are_refused_whatever_the_content_type(client, content_type, field):
    response = post(client, json.dumps(BODY | field), content_type)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith(f"{next(iter(field))}: per-request aux-flow settings are not supported")


def test_other_requests_reach_the_route(client):
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        response = post(client, json.dumps(BODY), content_type)
        assert (response.status_code, response.json()) == (200, {"prompt": "w7 w8"})
    assert post(client, b"not json {", "application/json").status_code == 422  # the route's own validation answers
    assert post(client, b"\xff\xfe binary", "application/octet-stream").status_code == 422
