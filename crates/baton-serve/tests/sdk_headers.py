"""The header names the official `openai` package sends with a chat completion, as one JSON
list: what a browser running an SDK would name in its CORS preflight. The request goes to a
transport of the package's own HTTP library that answers nothing, so no server is needed.

    python sdk_headers.py

Run by serve.rs (an_allowed_page_may_send_the_official_sdks_headers).
"""

import json

import openai

try:  # the HTTP library the pinned package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

seen = {}


def answer(request):
    seen.update(request.headers)
    return httpx.Response(500, json={"error": {"message": "not a server"}})


client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0,
                       http_client=httpx.Client(transport=httpx.MockTransport(answer)))
try:
    client.chat.completions.create(model="baton", messages=[{"role": "user", "content": "Hi?"}])
except openai.APIStatusError:
    pass
print(json.dumps(sorted(seen)))
