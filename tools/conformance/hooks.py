"""Schemathesis hooks for Duet's conformance test.

Requests generated from the OpenAI document name random models and ask for any number of
tokens. A case that is valid so far gets the served model (from DUET_MODEL) and at most 8 new
tokens, so it reaches the model and its 200 is checked against the document; a field that was
made invalid on purpose (negative testing) is left as it is, and must still be refused.
"""

import os

import schemathesis

MODEL = os.environ["DUET_MODEL"]
MAX_NEW = 8


@schemathesis.hook
def map_body(ctx, body):
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW:
            body[key] = MAX_NEW
    # Absent or null (the document allows null; it means "no limit") both run to the
    # context's end: give them the limit, which keeps the case valid.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW
        body.pop("max_completion_tokens", None)
    return body


@schemathesis.hook
def map_path_parameters(ctx, path_parameters):
    if isinstance(path_parameters, dict) and "model" in path_parameters:
        path_parameters["model"] = MODEL
    return path_parameters
