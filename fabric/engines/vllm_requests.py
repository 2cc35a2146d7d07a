"""What the connector's scheduler side keeps of each vLLM request it serves: its
namespace and page-hash chain over whole pages of real tokens, the fabric's
answer, and where its loads and stores stand.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, pack_tokens
from fabric.engines.vllm_identity import lora_identity

log = logging.getLogger(__name__)


@dataclass
class TrackedRequest:
    request: Any  # vLLM's Request
    namespace: str
    seed: bytes
    tag: str  # the engine's tag when the request came: it stores only while it holds
    hashes: list[bytes] = field(default_factory=list)  # whole pages of real tokens
    fabric_pages: int | None = None  # the fabric's answer: leading pages loadable
    asked_tag: str = ""  # the tag the answer is under
    load: tuple[int, int] | None = None  # pages [start, end) to load when scheduled
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0  # pages below this are in the fabric or being stored
    waiting_on: set[int] = field(default_factory=set)  # loads its blocks depend on
    scheduled: bool = False  # in a step since its last lookup (a later lookup: resumed)
    first_computed: int | None = None  # its first token it computed (or loaded) itself
    no_save: bool = False  # its KV cannot be vouched for (a load never reported)
    async_loading: bool = False  # an asynchronous load is writing its blocks
    l1_named: int = 0  # its blocks whose hash in vLLM is paired with the page's (vllm_l1)
    # A hybrid engine's (``vllm_hybrid``): every group's block table as this step
    # scheduled it, the states vLLM handed off this step, and what of its other
    # groups the request stored: (group, page).
    tables: tuple[list[int], ...] | None = None
    offloads: list[tuple[int, int, int]] = field(default_factory=list)
    component_saved: set[tuple[int, int]] = field(default_factory=set)

    @property
    def rid(self) -> str:
        return self.request.request_id

    def whole(self, block_size: int) -> int:
        """Pages of the request's tokens so far a load may cover: whole, the last
        token computed."""
        return max((self.request.num_tokens - 1) // block_size, 0)

    def hashes_to(self, pages: int, block_size: int) -> None:
        """Extend ``hashes`` to ``pages`` pages of the request's real tokens (a page
        not yet whole, or not yet known — async scheduling's placeholders, draft
        tokens — is never hashed)."""
        pages = min(pages, self.request.num_tokens // block_size)
        have = len(self.hashes)
        if pages <= have:
            return
        tokens = self.request.all_token_ids[have * block_size : pages * block_size]
        prev = self.hashes[-1] if self.hashes else self.seed
        self.hashes += chain_hashes(prev, pack_tokens(tokens), block_size * TOKEN_BYTES)


# What a request asks the fabric to keep of its prefix once it ends, in vLLM's
# ``kv_transfer_params``: a session (a conversation's id: its pages kept warm for
# the fabric's cache.session_ttl_s, until its next turn takes over) and a pin
# (kept for this many seconds).
SESSION_PARAM = "kvfabric_session"
PIN_PARAM = "kvfabric_pin_s"
MAX_HOLD_NAME = 256
MAX_PIN_S = 7 * 24 * 3600.0


def ask_holds(state: TrackedRequest, done: int, block_size: int, link: Any, world: int) -> None:
    """The request ended with ``done`` tokens computed: ask the fabric (``link``) to
    hold the session and the pin its ``kv_transfer_params`` ask for (a bad value is
    logged, naming it, and ignored: the request is served all the same)."""
    params = getattr(state.request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not (SESSION_PARAM in params or PIN_PARAM in params):
        return
    state.hashes_to(done // block_size, block_size)
    chain = state.hashes[: done // block_size]
    if not chain:
        return
    session, pin_s = params.get(SESSION_PARAM), params.get(PIN_PARAM)
    if session is not None:
        if isinstance(session, str) and 0 < len(session) <= MAX_HOLD_NAME:
            link.hold(state.tag, world, chain, session, "session", None)
        else:
            log.warning(
                "kvfabric connector: %s=%r is ignored: allowed is a non-empty str of at most "
                "%d characters", SESSION_PARAM, session, MAX_HOLD_NAME,
            )  # fmt: skip
    if pin_s is not None:
        good = isinstance(pin_s, (int, float)) and not isinstance(pin_s, bool)
        if good and 0 < pin_s <= MAX_PIN_S:
            link.hold(state.tag, world, chain, "pin/" + chain[-1].hex(), "pin", float(pin_s))
        else:
            log.warning(
                "kvfabric connector: %s=%r is ignored: allowed is a number of seconds in "
                "(0, %.0f]", PIN_PARAM, pin_s, MAX_PIN_S,
            )  # fmt: skip


def unkeyed(request: Any) -> bool:
    """Whether a request's KV is not named by its token ids: images and other
    multimodal inputs, prompt embeddings (whose token ids are placeholders)."""
    return bool(getattr(request, "mm_features", None)) or (
        getattr(request, "prompt_embeds", None) is not None
    )


class LoraIdentities:
    """LoRA adapters' identities (``vllm_identity.lora_identity``) by vLLM's adapter
    id, taken when the engine first serves the adapter. vLLM keeps an adapter it
    has loaded under its id and does not read it again, so an adapter whose files
    change on disk afterwards is no longer served by the fabric (its KV may be
    either version's) until the engine restarts."""

    MAX = 1024

    def __init__(self) -> None:
        self._known: dict[Any, tuple[tuple, str]] = {}
        self._changed: set[Any] = set()

    def identity(self, lora_request: Any) -> str | None:
        """``None``: the adapter is not served (its files cannot be read, or they
        changed while the engine has it loaded)."""
        path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", "")
        adapter = getattr(lora_request, "lora_int_id", None) or path
        if adapter in self._changed:
            return None
        try:
            key: tuple = (path, *sorted(
                (e.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                for e in os.scandir(path) for st in (e.stat(),)
            ))  # fmt: skip
        except OSError:
            key = (path,)  # a hub repo's snapshot, fingerprinted where it lies
        known = self._known.get(adapter)
        if known is not None:
            if known[0] == key:
                return known[1]
            log.warning(
                "kvfabric connector: LoRA adapter %r changed on disk while the engine has it "
                "loaded; its requests are served without the fabric",
                getattr(lora_request, "lora_name", adapter),
            )
            self._changed.add(adapter)
            return None
        identity = lora_identity(lora_request)
        if identity is not None:
            if len(self._known) >= self.MAX:
                self._known.clear()
            self._known[adapter] = (key, identity)
        return identity
