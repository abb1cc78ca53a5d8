"""Anthropic's Messages API, spoken by `kvpool serve` on /v1/messages: its wire format and its
translation to and from the chat completions path, which does the work. Like
`kvpool.openai`, nothing here imports the server; the route is `kvpool/server/messages_routes.py`.

    protocol.py    pydantic models: the request, the `Message`, the stream's events, the error
    convert.py     a request as a `ChatCompletionRequest`; an output as a `Message`
    stream.py      `MessageStreamer`: an output's deltas as Anthropic's event sequence
    errors.py      `error_body`: any server error in Anthropic's shape
"""
