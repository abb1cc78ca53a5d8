"""The OpenAI-compatible HTTP surface that `kvpool serve` (kvpool.server) and `kvpool router`
(kvpool.router) both speak: request and response models, OpenAI-shaped errors, API keys and
tenants (and the cache salt a tenant implies), the auth and body-limit middleware, and prompt
tokenizing. Neither the server nor the router is imported from here; importing this package
loads nothing heavy.

    protocol.py    pydantic models of the requests and responses
    errors.py      `OpenAIError` and the handlers that render every error in OpenAI's shape
                   (or, by path, another API's: `ErrorShape`)
    auth.py        `ApiKeyTable`, tenants, `TenantSalts`
    middleware.py  `AuthMiddleware`, `BodyLimitMiddleware`, `AccessPolicy`
    prompts.py     `prompt_list`, `tokenize_prompt`, `EnginePrompt`
    responses_api/ the Responses API (/v1/responses) as a translation onto chat completions
"""
