"""The server's non-generation endpoints, shaped as vLLM's: `/v1/models`, `/tokenize`,
`/detokenize`, `/version` and `/ping`.

    GET  /v1/models      vLLM's model cards (`ModelCard`, `ModelPermission`)
    POST /tokenize       a prompt, or chat messages through the chat template -> token ids
    POST /detokenize     token ids -> text (ids outside the vocabulary: 400 naming `tokens`)
    GET  /version        {"version": kvpool.__version__}
    GET|POST /ping       /health under vLLM's (SageMaker's) name

Tokenizing runs in a worker thread, as the generation routes' does, so a long prompt never
holds the event loop. Nothing here touches the engine thread. Authentication is the
middleware's: /ping is open like /health; the rest need a key when keys are configured.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

import kvpool
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import ChatMessage, ErrorResponse, RequestModel, TokenId
from kvpool.server.config import DEFAULT_MODEL_NAME
from kvpool.server.generation import ServerState
from kvpool.server.routes import health

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)
}

router = APIRouter()


# ------------------------------------------------------------------ wire format
class ModelPermission(BaseModel):
    """vLLM's permission record (OpenAI's legacy shape), with vLLM's defaults."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """vLLM's model card: `root` is the model the server loaded (a path or preset), `parent`
    the base model of an adapter (None: there are no adapters here)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpool"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """vLLM's two tokenize bodies in one: a completion's `prompt`, or chat `messages` with
    their template options. One model rather than a union, so that a bad body's 400 names the
    field (a union's errors are located under the branch's class name)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # chat only
    continue_final_message: bool = False  # chat only
    add_special_tokens: bool | None = None  # None: true for a prompt (e.g. BOS), false for chat
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# ------------------------------------------------------------------ routes
def _state(request: Request) -> ServerState:
    return request.app.state.kvpool


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    root = state.engine.engine.config.load.model or DEFAULT_MODEL_NAME
    cards = [
        ModelCard(id=name, created=state.created, root=root,
                  max_model_len=state.engine.max_model_len, permission=[ModelPermission()])
        for name in state.config.served_model_names
    ]
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = _state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    tokenizer = _tokenizer(state, "prompt" if body.messages is None else "messages")
    token_ids = await state.input_work.run(request.state.tenant, _token_ids, tokenizer, body,
                                           state.config.chat_template,
                                           state.engine.prompt_limits)
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=state.engine.max_model_len,
                            tokens=token_ids, token_strs=token_strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = _state(request)
    state.check_model(body.model)
    tokenizer = _tokenizer(state, "tokens")
    # vLLM's bound: an id either the tokenizer or the model knows.
    vocab_size = max(tokenizer.vocab_size, state.engine.engine.model_config.vocab_size)
    if any(token_id >= vocab_size for token_id in body.tokens):
        raise bad_request(f"tokens must be in [0, {vocab_size})", "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


@router.get("/version", responses=_ERRORS)
async def version() -> dict[str, str]:
    return {"version": kvpool.__version__}


@router.get("/ping", responses=_ERRORS)
@router.post("/ping", include_in_schema=False)  # an alias, with nothing a schema could add
async def ping(request: Request) -> dict[str, str]:
    """As vLLM's: the health check under the name SageMaker probes (GET or POST)."""
    return await health(request)


def _tokenizer(state: ServerState, param: str) -> Any:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", param)
    return tokenizer


def _token_ids(tokenizer: Any, body: TokenizeRequest, template: str | None,
               limits: PromptLimits) -> list[int]:
    """The ids the engine would get for this prompt: a completion's, or a chat's rendered
    with the server's `--chat-template` (`template`) if it has one, else the model's."""
    if body.messages is None:
        assert body.prompt is not None
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            limits.check_text(body.prompt)  # text no tokenization fits is not tokenized
            return tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)
        except InvalidRequestError as error:
            raise bad_request(str(error), "prompt") from error
        except (ValueError, TypeError) as error:  # e.g. a lone surrogate, not encodable
            raise bad_request("prompt: the text could not be tokenized", "prompt") from error
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    if body.add_generation_prompt and body.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")
    if template is None and not tokenizer.has_chat_template:
        raise bad_request("this model has no chat template; use a prompt", "messages")
    conversation = [{"role": "system" if m.role == "developer" else m.role,
                     "content": _content_text(m)} for m in body.messages]
    options: dict[str, Any] = {"chat_template": template} if template else {}
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=body.add_generation_prompt, tokenize=False,
            continue_final_message=body.continue_final_message, **options)
        return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    except Exception as error:  # the template rejected the conversation (jinja raises anything)
        raise bad_request("the chat template cannot render these messages", "messages") from error


def _content_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)
