"""OpenAI's Responses API (`POST /v1/responses`), stateless, as a translation onto the chat
completions pipeline (the route: `kvpool/server/responses_api_routes.py`). Not to be confused
with `kvpool/server/responses.py`, which builds the chat and completion response bodies.

    protocol.py   pydantic models: the request, the response object, output items, usage
    convert.py    a request as a `ChatCompletionRequest`; the output as a response object
    stream.py     the event sequence of a streamed response
    errors.py     the chat pipeline's errors renamed to the Responses fields
"""
