"""The OpenAI wire: what flywheel's HTTP servers and its client SDK say to each other.

    requests.py   ChatRequest, TextCompletionRequest (OpenAI's, the parts served) and their parsing
    responses.py  the chat.completion / text_completion / model records, tool calls and logprobs as sent
    streaming.py  server-sent events: chat.completion.chunk lines and the closing [DONE]
    events.py     the feedback Event a client sends to POST /v1/events, and the batch's answer
    errors.py     ApiError, OpenAI's error shape, and the one set of handlers every app installs
    http.py       body limits, the OpenAPI document's helpers, and a server on a background thread

Both servers speak it: the live server (flywheel/live/server.py and its routers) and the harness
server (flywheel/rl/harness/server.py), and the SDK (flywheel/client.py) sends its events. It knows no
stage: nothing here imports the rest of flywheel, so a program that only sends events imports this
package and httpx, not the server's stage.
"""
