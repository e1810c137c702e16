"""
`--middleware dualflow.serving.middleware.refuse_aux_fields` for vLLM's OpenAI server: the aux flow's settings
(`use_aux_flow`, `aux_*`) are engine settings, fixed when the engine is built (`--hf-overrides`). vLLM's server drops
request fields it does not know, so a request carrying them would silently run with the engine's settings; this
middleware answers 400 instead.
"""

import json

from starlette.requests import Request
from starlette.responses import JSONResponse


def aux_fields(body: object) -> list[str]:
    """The aux-flow settings among a JSON request body's top-level fields."""
    if not isinstance(body, dict):
        return []
    return sorted(key for key in body if key == "use_aux_flow" or key.startswith("aux_"))


async def refuse_aux_fields(request: Request, call_next):
    # Every POST body is read, whatever its Content-Type says: vLLM takes `Application/JSON; charset=utf-8` as JSON,
    # and a JSON body under another type must not pass either.
    if request.method == "POST":
        try:
            fields = aux_fields(json.loads(await request.body()))
        except ValueError:  # not JSON (UnicodeDecodeError included): the server's own validation answers
            fields = []
        if fields:
            message = (
                f"{', '.join(fields)}: per-request aux-flow settings are not supported; they are engine settings "
                "(start the server with --hf-overrides, e.g. '{\"use_aux_flow\": false}')"
            )
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, 400)
    return await call_next(request)
