"""The official `openai` client against a live Duet cluster. Usage: openai_client.py BASE_URL MODEL

Each check asserts; the script exits non-zero on the first failure.
"""

import sys

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused")

# /v1/models lists the served model.
assert [m.id for m in client.models.list().data] == [model]

# Chat completion, greedy: the reference answer.
chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=32, temperature=0
)
assert chat.choices[0].message.content == "The answer to this classic math problem is 4.", chat
assert chat.choices[0].finish_reason == "stop"
assert chat.usage.prompt_tokens == 37 and chat.usage.completion_tokens == 12, chat.usage

# Completion: max_tokens and finish_reason length; a prompt given as token ids.
comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
assert comp.choices[0].text == " Paris.\n\nThe", repr(comp.choices[0].text)
assert comp.choices[0].finish_reason == "length"
by_ids = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=5, temperature=0)
assert by_ids.choices[0].text == comp.choices[0].text

# Streaming chat and completion, with usage in the last chunk.
pieces, finish, usage = [], None, None
for chunk in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=32, temperature=0,
    stream=True, stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert "".join(pieces) == chat.choices[0].message.content, pieces
assert finish == "stop" and usage is not None and usage.completion_tokens == 12, (finish, usage)
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True)
)
assert streamed == comp.choices[0].text, streamed

# stop: the stop string ends the text and is not returned.
stopped = client.completions.create(model=model, prompt="The capital of France is", max_tokens=20, temperature=0, stop=["\n"])
assert stopped.choices[0].text == " Paris.", repr(stopped.choices[0].text)
assert stopped.choices[0].finish_reason == "stop"

# seed: the same seed reproduces a sampled (temperature > 0) output; logprobs come back.
def sampled(seed):
    r = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=seed, logprobs=1
    )
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs

a, b = sampled(1234), sampled(1234)
assert a == b, (a, b)
assert len(a[1]) == 16 and all(lp <= 0 for lp in a[1])

# Errors are OpenAI-shaped 4xx.
try:
    client.completions.create(model=model, prompt="hello " * 9000, max_tokens=5)
    raise AssertionError("an over-long prompt was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded", e.body
try:
    client.completions.create(model="gpt-4", prompt="hi", max_tokens=5)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.completions.create(model=model, prompt="hi", max_tokens=5, temperature=7)
    raise AssertionError("temperature 7 was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body

print("openai client: all checks passed")
