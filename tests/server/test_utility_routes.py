"""The non-generation endpoints through real HTTP: /tokenize and /detokenize agree with the
tokenizer and with what the generation routes count, /version and /ping answer, /v1/models
returns vLLM's complete cards, and errors keep vLLM's shape (an integer `code`) as the openai
client sees it."""

from __future__ import annotations

import httpx
import openai
import pytest

import kvpool
from tests.server.conftest import MODEL

PROMPT = "The lighthouse keeper climbed the stairs"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
CARD_FIELDS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len",
               "permission"}
PERMISSION_FIELDS = {"id", "object", "created", "allow_create_engine", "allow_sampling",
                     "allow_logprobs", "allow_search_indices", "allow_view",
                     "allow_fine_tuning", "organization", "group", "is_blocking"}


@pytest.fixture
def server(make_server):
    return make_server(max_model_len=512)


def post(server, path: str, body: object) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body)


def test_tokenize_a_prompt_as_a_completion_would(server, fast_model) -> None:
    tokenizer = fast_model.tokenizer
    body = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert plain["token_strs"] is None
    completion = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]


def test_tokenize_messages_through_the_chat_template(server, fast_model) -> None:
    tokenizer = fast_model.tokenizer
    body = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert body["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    reply = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == body["count"]
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=False)
    assert bare.json()["count"] < body["count"]


def test_tokenize_refusals_name_their_field(server) -> None:
    unknown = post(server, "/tokenize", {"model": "other", "prompt": PROMPT})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"
    empty = post(server, "/tokenize", {"messages": []})
    assert empty.status_code == 400
    assert empty.json()["error"] == {"message": "messages must not be empty",
                                     "type": "invalid_request_error", "param": "messages",
                                     "code": 400}
    both = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                                      "continue_final_message": True})
    assert both.json()["error"]["param"] == "continue_final_message"
    for body in ({"prompt": 5}, {}, {"prompt": PROMPT, "messages": MESSAGES}):
        refused = post(server, "/tokenize", body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "prompt"
    assert post(server, "/tokenize", {"messages": "hi"}).json()["error"]["param"] == "messages"


def test_detokenize_inverts_tokenize(server, fast_model) -> None:
    tokens = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    body = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert body == {"prompt": PROMPT}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[1, 10**9], [-1], "12"])
def test_detokenize_refuses_ids_outside_the_vocabulary(server, tokens: object) -> None:
    response = post(server, "/detokenize", {"tokens": tokens})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("tokens", 400)
    assert str(10**9) not in error["message"]


def test_version_and_ping(server) -> None:
    with server.http() as http:
        assert http.get("/version").json() == {"version": kvpool.__version__}
        assert http.get("/ping").json() == {"status": "ok"}
        assert http.post("/ping").json() == {"status": "ok"}


def test_models_are_vllms_complete_cards(server) -> None:
    with server.http() as http:
        listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert set(card) == CARD_FIELDS
    assert (card["id"], card["object"], card["owned_by"]) == (MODEL, "model", "kvpool")
    assert card["root"] == "SmolLM2-135M-Instruct"  # the model loaded (the bundled default)
    assert card["parent"] is None and card["max_model_len"] == 512
    (permission,) = card["permission"]
    assert set(permission) == PERMISSION_FIELDS
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"]
    assert not permission["allow_fine_tuning"] and permission["organization"] == "*"
    models = server.client().models.list()
    assert [model.id for model in models] == [MODEL]


def test_errors_carry_the_status_as_an_integer_code(server) -> None:
    """vLLM's error shape, through the official client: `body` keeps the integer, and the
    client's own `.code` is its string form."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    body = refused.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error",
                                                           "max_tokens", 400)
    assert "maximum context length" in body["message"] and "512" in body["message"]
    assert refused.value.code == "400"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)
    assert (missing.value.body["code"], missing.value.body["param"]) == (404, "model")
