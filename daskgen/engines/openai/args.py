"""Engine args of the ``openai`` engine (:class:`OpenAIArgs`) and their validation."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from daskgen.engines.args import check_number
from daskgen.engines.openai.server import check_server_args
from daskgen.errors import ConfigError

__all__ = ["APIS", "OpenAIArgs"]

APIS = ("auto", "sglang", "vllm", "chat", "completions")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass
class OpenAIArgs:
    """Options of the ``openai`` engine (the table in ``docs/engines.md`` says more).

    Attributes
    ----------
    base_url:
        Server address, e.g. ``http://127.0.0.1:30000`` (``.../v1`` too); required unless ``managed``.
    model_name:
        Model for OpenAI requests, checked against ``/v1/models``; default the only served one, else ``model``.
    api_key_env:
        NAME of the environment variable holding the API key.
    api:
        ``"auto"``, ``"sglang"`` (native, token-exact), ``"vllm"`` (token ids through vLLM's
        completions, token-exact), ``"completions"`` or ``"chat"``.
    extra_body:
        Merged into every request body (native: ``sampling_params`` into the sampling parameters).
    max_concurrency, timeout_s:
        Requests in flight at once (default 128; against an SGLang server, unless set, twice the
        server's ``max_running_requests`` when that is more, so its queue never runs dry); read
        timeout (seconds without data from the server).
    max_retries, backoff_s:
        Retries after 429/408/5xx/connection errors, and the first backoff (doubling, plus jitter).
    managed, server_args, server_start_timeout_s:
        Start one sglang server per engine, its ``launch_server`` options, and how long to wait for it.
    tokenizer:
        Tokenizer for decoding prompts and re-tokenizing text; default ``model``.
    """

    base_url: str | None = None
    model_name: str | None = None
    api_key_env: str | None = None
    api: str = "auto"
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int = 128
    timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 0.5
    managed: bool = False
    server_args: dict[str, Any] = field(default_factory=dict)
    server_start_timeout_s: float = 600.0
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"openai engine: api must be one of {list(APIS)}, got {self.api!r}")
        if not isinstance(self.managed, bool):
            raise ConfigError(f"openai engine: managed must be true or false, got {self.managed!r}")
        for name in ("extra_body", "server_args"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"openai engine: {name} must be a mapping, got {getattr(self, name)!r}")
        for name, low, integer in (
            ("max_concurrency", 1, True),
            ("max_retries", 0, True),
            ("backoff_s", 0, False),
            ("timeout_s", None, False),
            ("server_start_timeout_s", None, False),
        ):
            check_number("openai", name, getattr(self, name), low, integer)
        key_env = self.api_key_env
        if key_env is not None and not (isinstance(key_env, str) and _ENV_NAME.match(key_env)):
            raise ConfigError(
                "openai engine: api_key_env must be the NAME of an environment variable holding the "
                "key (e.g. OPENAI_API_KEY), not the key itself"
            )
        self._check_target()

    def _check_target(self) -> None:
        if self.managed:
            if self.base_url is not None:
                raise ConfigError(
                    "openai engine: give either base_url (an existing server) or managed=true "
                    "(a server started per worker), not both"
                )
            if self.api_key_env is not None:
                raise ConfigError(
                    "openai engine: daskgen gives every managed server a random API key of its own; drop api_key_env"
                )
            check_server_args(self.server_args)
        elif not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"openai engine: base_url must be an http(s) URL such as http://127.0.0.1:30000 "
                f"(or set managed=true), got {self.base_url!r}"
            )
        elif self.server_args:
            raise ConfigError("openai engine: server_args apply to managed servers only (managed=true)")
