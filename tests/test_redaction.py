"""One secret rule (daskgen.redaction) for store attrs, engine descriptions and managed-server arguments."""

from __future__ import annotations

import pytest

from daskgen.engines.openai.server import check_server_args
from daskgen.engines.sglang import SGLangEngine
from daskgen.errors import ConfigError
from daskgen.redaction import is_secret_key, redact, redact_url

SECRETS = [
    "api_key",
    "admin_api_key",
    "apikey",
    "hf_token",
    "access_token",
    "token",
    "ssl_keyfile_password",
    "client_secret",
    "password",
    "credentials",
]
NOT_SECRETS = [
    "bucket_time_to_first_token",
    "kt_max_deferred_experts_per_token",
    "max_new_tokens",
    "eos_token_id",
    "tokenizer",
    "api_key_env",
    "ssl_keyfile",
    "tp_size",
]


def test_the_rule() -> None:
    assert [k for k in SECRETS if not is_secret_key(k)] == []
    assert [k for k in NOT_SECRETS if is_secret_key(k)] == []
    config = {"engine_args": {"api_key": "sk-1", "tp_size": 2, "nested": [{"hf_token": "t"}]}, "empty_key": ""}
    assert redact(config) == {
        "engine_args": {"api_key": "***", "tp_size": 2, "nested": [{"hf_token": "***"}]},
        "empty_key": "",
    }
    assert redact_url("https://user:pw@host:1/v1") == "https://host:1/v1"


def test_engines_and_managed_servers_use_the_same_rule() -> None:
    args = {"api_key": "sk-planted", "bucket_time_to_first_token": [0.1, 1.0], "tp_size": 1}
    described = SGLangEngine("/m", **args).describe()["engine_args"]
    assert described == {"api_key": "***", "bucket_time_to_first_token": [0.1, 1.0], "tp_size": 1}
    for key in ("api_key", "admin_api_key", "ssl_keyfile_password"):
        with pytest.raises(ConfigError, match="must not contain"):
            check_server_args({key: "x"})
    check_server_args({"bucket_time_to_first_token": [0.1], "tp_size": 2})
