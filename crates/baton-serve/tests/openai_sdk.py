"""The official `openai` package against a running `baton serve`: models, chat completions
streamed and not, the usage and `baton` fields, each error class, and a client that hangs up.

    python openai_sdk.py BASE_URL TOKEN

Run by serve.rs (the_official_openai_package_…), which starts the server over loopback workers and then checks the history
(the cancelled run). Prints one JSON line of facts for it; exits non-zero on the first failure.
"""

import json
import sys

import openai

base_url, token = sys.argv[1], sys.argv[2]
# No retries: a 429 must reach the test, not be waited out.
client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0)
facts = {"sdk": openai.__version__}

ids = [m.id for m in client.models.list()]
assert ids == ["baton", "baton/fast", "baton/slow"], ids

# Not streamed.
r = client.chat.completions.create(
    model="baton",
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    max_completion_tokens=50,
)
answer = r.choices[0].message.content
assert answer, r
baton = r.model_extra["baton"]
assert baton["status"] == "finished" and baton["run_id"], baton
details = r.usage.prompt_tokens_details.model_extra
assert details["orchestration_input_tokens"] > 0, r.usage
assert r.usage.completion_tokens_details.model_extra["orchestration_output_tokens"] > 0, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
raw = client.chat.completions.with_raw_response.create(
    model="baton/fast", messages=[{"role": "user", "content": "Hello?"}]
)
assert raw.headers["x-baton-run-id"] == raw.parse().model_extra["baton"]["run_id"]
assert float(raw.headers["x-baton-cost-usd"].lstrip(">=")) >= 0
facts["answer"] = answer

# Streamed: progress as reasoning_content, the answer as content, usage at the end.
content, reasoning, usage, last = "", "", None, None
with client.chat.completions.create(
    model="baton",
    messages=[{"role": "user", "content": "Name three primary colours."}],
    stream=True,
    stream_options={"include_usage": True},
) as stream:
    for chunk in stream:
        assert chunk.model_extra["baton"]["run_id"], chunk
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            if choice.finish_reason:
                last = chunk
assert content and "Step 1" in reasoning, (content, reasoning)
assert last.model_extra["baton"]["status"] == "finished", last
assert usage.prompt_tokens_details.model_extra["orchestration_input_tokens"] > 0, usage
facts["streamed"] = content

# Each error class.
def fails(exception, **kwargs):
    try:
        client.chat.completions.create(**{"messages": [{"role": "user", "content": "Hi?"}], "model": "baton", **kwargs})
    except exception as e:
        return e
    raise AssertionError(f"no {exception.__name__} for {kwargs}")

e = fails(openai.BadRequestError, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
assert e.status_code == 400 and e.param == "tools" and "tools" in e.message, e
e = fails(openai.BadRequestError, n=3)
assert e.param == "n", e
e = fails(openai.NotFoundError, model="gpt-4o")
assert e.code == "model_not_found", e
e = fails(openai.RateLimitError, model="baton/fast", extra_headers={"x-baton-max-tokens": "3"})
assert e.code == "budget_exceeded", e
wrong = openai.OpenAI(base_url=base_url, api_key="not-the-token", max_retries=0)
try:
    wrong.models.list()
    raise AssertionError("a wrong token was let in")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e

# The Responses API: text in and out, streamed and not, continued by previous_response_id.
first = client.responses.create(model="baton", input="Why is the sea salty?", instructions="Be brief.")
assert first.status == "completed" and first.output_text, first
assert first.usage.input_tokens_details.model_extra["orchestration_input_tokens"] > 0, first.usage
assert first.model_extra["baton"]["status"] == "finished"
deltas, completed = "", None
with client.responses.stream(model="baton/fast", input="And the rivers?", previous_response_id=first.id) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas += event.delta
        elif event.type == "response.completed":
            completed = event.response
assert completed is not None and completed.output_text == deltas and deltas, (deltas, completed)
assert completed.previous_response_id == first.id
try:
    client.responses.create(model="baton", input="Hi?", tools=[{"type": "web_search"}])
    raise AssertionError("tools were not refused")
except openai.BadRequestError as e:
    assert e.param == "tools", e
facts["responses"] = deltas

# A client that hangs up mid-answer: the run is cancelled (the test reads the history).
stream = client.chat.completions.create(
    model="baton/slow", messages=[{"role": "user", "content": "Write at length."}], stream=True
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        facts["hung_up_on"] = chunk.model_extra["baton"]["run_id"]
        break
stream.close()

print(json.dumps(facts))
