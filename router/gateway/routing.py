"""The routing step of a request (docs/dispatch.md, 1), free of I/O: its body parsed strictly
once (core/strict_json.py) and checked, tokenize -> block keys -> match -> policy, the body
rebuilt for the worker (docs/isolation.md); a Responses request routed as the chat it renders
as, an embeddings request by load alone; and the routing modes: live or degraded (least load),
shadows that only watch."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import msgspec

from core.blocks import block_keys
from core.errors import APIError
from core.responses_input import InputError, chat_messages
from core.strict_json import BodyError, decode_object, encode
from router.dispatch import candidate, candidates
from router.gateway.fleet import Fleet, Model, Worker
from router.gateway.isolation import leading_system, public_tokens
from router.index import UnifiedIndex
from router.policies import Candidate, Decision, Policy, RouteRequest, make_policy
from router.shadow import ShadowPolicies

SALT_FIELD: Final = "cache_salt"
PUBLIC_FIELD: Final = "urc_public_tokens"
RESERVED_PREFIX: Final = "urc_"
TOKEN_ID_MAX: Final = 2**31 - 1  # block keys hash token ids as int32
EMBEDDING_INPUTS_MAX: Final = 2048  # OpenAI's limit of inputs per embeddings request


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def parse_body(raw: bytes, checked: str = "") -> dict[str, Any]:
    """A JSON object body, strictly parsed (400 otherwise)."""
    try:
        return decode_object(raw, checked=checked)
    except BodyError as exc:
        raise bad_request(str(exc)) from None


def parse_request(raw: bytes, chat: bool) -> dict[str, Any]:
    """An inference request's body, its routing fields checked (a prompt once, by `validate`:
    token ids in int32 are within the parse's limits too)."""
    body = parse_body(raw, "" if chat else "prompt")
    validate(body, chat)
    return body


def _check_int(body: dict[str, Any], field: str, low: int = 0) -> None:
    value = body.get(field)
    if value is not None and (type(value) is not int or value < low):
        raise bad_request(f"'{field}' must be an integer >= {low}", field)


def _token_ids(prompt: list[Any]) -> bool:
    if not prompt:
        return False
    for token in prompt:
        if not isinstance(token, int) or isinstance(token, bool):
            return False
        value: int = token  # compiled: compared as a native int
        if value < 0 or value > TOKEN_ID_MAX:
            return False
    return True


def validate(body: dict[str, Any], chat: bool) -> None:
    """The fields routing needs, in OpenAI's wording; the rest is the worker's to check."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and _token_ids(prompt))):
            message = f"'prompt' must be a string or an array of token ids in [0, {TOKEN_ID_MAX}]"
            raise bad_request(message, "prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    _check_int(body, "max_tokens")
    _check_int(body, "max_completion_tokens")
    _check_int(body, "n", 1)


def parse_responses(raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses request's body, and the chat request it is routed as: its model and tools,
    its `instructions` and `input` as messages (core/responses_input.py)."""
    body = parse_body(raw)
    if body.get("previous_response_id") is not None:
        message = (
            "'previous_response_id' is not supported: the gateway keeps no responses, "
            "send the whole conversation as 'input'"
        )
        raise bad_request(message, "previous_response_id")
    try:
        messages = chat_messages(body)
    except InputError as exc:
        raise bad_request(str(exc), exc.param) from None
    routed: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools") is not None:
        routed["tools"] = body["tools"]
    validate(routed, True)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    _check_int(body, "max_output_tokens", 1)
    return body, routed


def parse_embeddings(raw: bytes) -> tuple[dict[str, Any], list[Any]]:
    """An embeddings request's body and its inputs, each a string or a list of token ids
    (OpenAI's four shapes of `input`, checked here: the strict parse skips it)."""
    body = parse_body(raw, "input")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    value = body.get("input")
    items: list[Any] = []
    if isinstance(value, str) or (isinstance(value, list) and _token_ids(value)):
        items = [value]
    elif isinstance(value, list):
        items = value
    if not items or len(items) > EMBEDDING_INPUTS_MAX:
        message = f"'input' must hold 1 to {EMBEDDING_INPUTS_MAX} inputs"
        raise bad_request(message, "input")
    for item in items:
        if not ((isinstance(item, str) and item) or (isinstance(item, list) and _token_ids(item))):
            message = (
                "'input' must be a non-empty string, an array of non-empty strings, an array "
                f"of token ids in [0, {TOKEN_ID_MAX}] or an array of such arrays"
            )
            raise bad_request(message, "input")
    return body, items


def forwarded(body: dict[str, Any], salt: str | None, public_tokens: int) -> bytes:
    """The worker's body: the gateway's fields first, then the client's, none reserved."""
    out: dict[str, Any] = {}
    if salt is not None:
        out[SALT_FIELD] = salt
        if public_tokens:
            out[PUBLIC_FIELD] = public_tokens
    for key, value in body.items():
        if key != SALT_FIELD and not key.startswith(RESERVED_PREFIX):
            out[key] = value
    return encode(out)


class Plan:
    """A routed request: what the policy saw and chose (`decision`), and where it may go."""

    __slots__ = (
        "model",
        "decision",
        "workers",
        "decision_s",
        "arrived",
        "policy",
        "public_tokens",
        "prefix_cache",
    )

    def __init__(
        self,
        model: Model,
        decision: Decision,
        workers: list[Worker],
        decision_s: float,
        arrived: float,
        policy: str,
        public_tokens: int = 0,
        prefix_cache: bool = True,
    ) -> None:
        self.model = model
        self.decision = decision
        self.workers = workers  # the candidates' workers, in the order the policy saw them
        self.decision_s = decision_s
        self.arrived = arrived  # time.monotonic() when routing began
        self.policy = policy  # the policy that decided
        self.public_tokens = public_tokens  # shared isolation: leading tokens keyed shared
        self.prefix_cache = prefix_cache  # False: embeddings (no prefix to predict or record)

    @property
    def request(self) -> RouteRequest:
        """What the policy saw (shadow policies see the same)."""
        return self.decision.request

    def candidate(self, worker: str) -> Candidate:
        return candidate(self.decision.candidates, worker)

    def matched(self, worker: str) -> int:
        """Tokens of the prompt `worker` can reuse, as the index says (router/dispatch.py), in
        either tier: the prediction of the cached tokens it reports."""
        c = self.candidate(worker)
        return self.decision.request.matched_tokens(c.matched_blocks + c.host_blocks)

    def host_matched(self, worker: str) -> int:
        """Of `matched(worker)`, the tokens in its host tier (docs/tiers.md)."""
        c = self.candidate(worker)
        return self.decision.request.host_tokens(c.matched_blocks, c.host_blocks)

    def route(self, worker: str) -> str:
        """The `x-urc-route` header's value for an answer from `worker`."""
        return (
            f"worker={worker}; matched_tokens={self.matched(worker)}; "
            f"host_tokens={self.host_matched(worker)}; "
            f"prompt_tokens={self.decision.request.prompt_tokens}; "
            f"reason={self.decision.reason}; policy={self.policy}"
        )

    def worker(self, name: str) -> Worker:
        for w in self.workers:  # a few candidates: a scan, not a dict per request
            if w.name == name:
                return w
        raise KeyError(name)

    def ranked(self) -> Iterator[Worker]:
        """The chosen worker, then (only if asked for: failover) the rest by the policy's cost."""
        yield self.worker(self.decision.worker)
        for name in self.decision.ranked()[1:]:
            yield self.worker(name)


SYSTEM_RENDERS = 1024  # shared isolation: distinct system prompts whose render is kept
_json = msgspec.json.Encoder(order="sorted")


class Router:
    def __init__(self, fleet: Fleet, index: UnifiedIndex, policy: Policy) -> None:
        self.fleet = fleet
        self.index = index
        self.policy = policy
        # (tokenizer, system messages and tools as JSON) -> their render: shared mode repeats a few
        self._system_renders: dict[tuple[object, bytes], Sequence[int]] = {}

    def tokens(self, model: Model, body: dict[str, Any], chat: bool) -> Sequence[int]:
        try:
            if chat:
                return model.tokenizer.encode_chat(body["messages"], body.get("tools"))
            prompt = body["prompt"]
            return model.tokenizer.prompt_ids(prompt) if isinstance(prompt, str) else prompt
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if chat else "prompt") from None

    def public_tokens(self, model: Model, body: dict[str, Any], tokens: Sequence[int]) -> int:
        """Shared isolation: the whole blocks of the leading system prompt."""
        system = leading_system(body["messages"])
        if not system:
            return 0
        key = (model.tokenizer, _json.encode([system, body.get("tools")]))
        rendered = self._system_renders.get(key)
        if rendered is None:
            rendered = self.tokens(model, {**body, "messages": system}, True)
            if len(self._system_renders) >= SYSTEM_RENDERS:
                del self._system_renders[next(iter(self._system_renders))]
            self._system_renders[key] = rendered
        return public_tokens(tokens, rendered, model.block_size)

    def plan(
        self,
        body: dict[str, Any],
        chat: bool,
        salt: str | None,
        policy: Policy | None = None,
        public: bool = False,
    ) -> Plan:
        arrived = time.monotonic()
        t0 = time.perf_counter()
        name = body["model"]
        model, workers = self._serving(name)
        group = model.kv_group
        tokens = self.tokens(model, body, chat)
        public_tokens = self.public_tokens(model, body, tokens) if public and chat and salt else 0
        public_blocks = public_tokens // model.block_size
        keys = block_keys(tokens, model.block_size, salt, public_blocks)
        if salt and len(keys) > public_blocks:  # where scoped invalidation finds the namespace
            self.index.tag_namespace(keys[public_blocks], salt)
        request = RouteRequest(keys, len(tokens), model.block_size, group, name)
        seen = candidates(self.index, request, self.fleet.loads(group), arrived)
        policy = policy or self.policy
        decision = policy.choose(request, seen)
        decision_s = time.perf_counter() - t0
        return Plan(model, decision, workers, decision_s, arrived, policy.name, public_tokens)

    def plan_embeddings(self, name: str, items: list[Any], policy: Policy) -> Plan:
        """An embeddings request: no prefix cache plays a part, so no block keys; its prompt
        tokens are the load it adds (`policy`: least load)."""
        arrived = time.monotonic()
        t0 = time.perf_counter()
        model, workers = self._serving(name)
        tokenizer = model.tokenizer
        tokens = 0
        for item in items:
            try:
                tokens += len(tokenizer.prompt_ids(item) if isinstance(item, str) else item)
            except ValueError as exc:
                raise bad_request(str(exc), "input") from None
        request = RouteRequest([], tokens, model.block_size, model.kv_group, name)
        seen = candidates(self.index, request, self.fleet.loads(model.kv_group), arrived)
        decision = policy.choose(request, seen)
        decision_s = time.perf_counter() - t0
        return Plan(model, decision, workers, decision_s, arrived, policy.name, 0, False)

    def _serving(self, name: str) -> tuple[Model, list[Worker]]:
        """The model `name` names and its up workers (404: no such model, 503: none up)."""
        model = self.fleet.models.get(name)
        if model is None:
            message = f"The model '{name}' does not exist"
            raise APIError(404, message, param="model", code="model_not_found")
        workers = self.fleet.candidates(model.kv_group)
        if not workers:
            message = f"no healthy worker serves model '{name}'"
            raise APIError(503, message, type="service_unavailable", code="no_worker")
        return model, workers


class RoutingModes:
    def __init__(
        self, live: Policy, shadows: list[str], prefill_tokens_per_s: float, degraded: bool
    ) -> None:
        self.live = live
        self.fallback = make_policy("least_load")
        self.manual = degraded  # the operator's switch
        self.auto = False  # the index is unhealthy
        self.shadow = ShadowPolicies(shadows, prefill_tokens_per_s)  # as `urc replay --shadow`

    @property
    def degraded(self) -> bool:
        return self.manual or self.auto

    def active(self) -> Policy:
        return self.fallback if self.degraded else self.live

    def describe(self) -> dict[str, object]:
        return {
            "mode": "degraded" if self.degraded else "live",
            "live_policy": self.live.name,
            "active_policy": self.active().name,
            "degraded_by_operator": self.manual,
            "degraded_by_index_health": self.auto,
            "shadows": self.shadow.describe(),
        }
