"""What a driver's call must be before the coordinator takes it: the checks of
``submit``, ``append``, ``pin`` and the rest, each raising ``InvalidInput`` that
names the value and what is allowed. Nothing here changes any state."""

from __future__ import annotations

from collections.abc import Sequence

from fabric.cache.keys import (
    MAX_NAMESPACE_CHARS,
    TOKEN_BYTES,
    TokenKey,
    check_namespace,
    check_vocab,
)
from fabric.cache.sessions import check_session_id
from fabric.config import FabricConfig
from fabric.coordinator.requests import ServingRequest
from fabric.errors import InvalidInput


class Intake:
    def __init__(self, config: FabricConfig) -> None:
        self.config = config
        self.allowed_namespaces = config.runtime.allowed_namespaces()

    def check_submit(
        self,
        prompts: Sequence[bytes],
        namespace: str,
        priority: int,
        request_ids: Sequence[str | None] | None,
        owner: str | None,
        session: str | None,
        release: Sequence,
    ) -> list[str | None]:
        """Check a ``submit_many`` call's arguments (each prompt's vocabulary and size
        come with ``request``); its request ids, one per prompt."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidInput("prompts must be a non-empty list of packed token bytes")
        if not isinstance(release, (list, tuple)):
            raise InvalidInput(f"release takes a list of Leases, not {type(release).__name__}")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if len(ids) != len(prompts):
            raise InvalidInput(
                f"{len(ids)} request ids for {len(prompts)} prompts: give one per prompt or none"
            )
        for tokens in prompts:
            if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
                raise InvalidInput("tokens must be a non-empty sequence of non-negative ints")
        if session is not None:
            check_session_id(session)
        self.check_namespace(namespace)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidInput(f"priority {priority!r} is refused: allowed is an int")
        if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= 64):
            raise InvalidInput(f"owner {owner!r} is refused: allowed is a Ray job id")
        return ids

    def check_namespace(self, namespace: str) -> None:
        check_namespace(namespace)
        if self.allowed_namespaces is not None and namespace not in self.allowed_namespaces:
            raise InvalidInput(
                f"namespace {namespace!r} is not allowed; allowed: {sorted(self.allowed_namespaces)}"
            )

    def check_vocab(self, tokens: bytes) -> None:
        """A model behind the ranks embeds every token: one outside its vocabulary
        would fail every rank's compute (and reset the epoch), so it is refused here."""
        if self.config.model.runs_model:
            check_vocab(tokens, self.config.model.vocab_size)

    def request(
        self,
        tokens: bytes,
        namespace: str,
        priority: int,
        rid: str,
        owner: str | None,
        session: str | None,
        now: float,
    ) -> ServingRequest:
        """A checked request for the packed ``tokens`` (their format checked already;
        not yet queued)."""
        self.check_vocab(tokens)
        prompt = len(tokens) // TOKEN_BYTES
        if prompt > self.config.cache.device_tokens:
            raise InvalidInput(
                f"prompt of {prompt} tokens is larger than L1 ({self.config.cache.device_tokens} "
                "tokens): raise cache.device_tokens to serve it"
            )
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_NAMESPACE_CHARS:
            raise InvalidInput(f"request_id {rid!r} is refused: allowed is a non-empty str")
        check_namespace(rid)  # the same rules: it travels in results and logs
        key = TokenKey(tokens, self.config.cache.page_size, namespace)
        return ServingRequest(
            rid, key, prompt, priority, now, owner, tokens=tokens, session=session
        )

    def check_append(self, leased_tokens: int, tokens: bytes) -> None:
        """Check the tokens a decode appends to a lease of ``leased_tokens``."""
        if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("append takes a non-empty sequence of non-negative ints")
        self.check_vocab(tokens)
        total = leased_tokens + len(tokens) // TOKEN_BYTES
        if total > self.config.cache.device_tokens:
            raise InvalidInput(
                f"request of {total} tokens would be larger than L1 "
                f"({self.config.cache.device_tokens} tokens): raise cache.device_tokens"
            )

    def key(self, tokens: bytes, namespace: str) -> TokenKey:
        """The key of a pin's or unpin's packed ``tokens``."""
        if not isinstance(tokens, bytes) or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("tokens must be a sequence of non-negative ints")
        self.check_namespace(namespace)
        return TokenKey(tokens, self.config.cache.page_size, namespace)
