"""Secret redaction: the one rule for what counts as a secret in configs, engine args and URLs.

* :func:`is_secret_key`, :func:`redact`: values whose key looks secret (``api_key``, ``admin_api_key``, ``hf_token``,
  ``ssl_keyfile_password``, ``client_secret``, ...; :data:`SECRET_KEY`) become ``"***"``,
  recursively.  Used for the store attrs (run config, engine description) and engine logs/errors,
  and to refuse secrets in a managed server's command line.
* :func:`redact_url`: user info dropped from a URL (``http://user:pw@host`` -> ``http://host``).

The HTTP client also replaces the API key's *value* in server messages
(:meth:`daskgen.engines.openai.client.HTTPClient.redact`), since a server may echo it back.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "SECRET_KEY", "is_secret_key", "redact", "redact_url"]

#: Keys whose values are secrets (matched on the lower-cased key, at its end).  ``token`` counts
#: alone or after a credential word (``hf_token``, ``access_token``), not as a count or position
#: (sglang's ``bucket_time_to_first_token``, ``..._per_token``).
SECRET_KEY = re.compile(
    r"(^|[_-])(api[_-]?key|key|secret|password|passwd|auth|authorization|credentials?)$"
    r"|(^|[_-])(api|access|auth|bearer|refresh|session|id|hf|github|gh|wandb)[_-]?token$|^token$"
)
#: What a secret value is replaced with.
MASK = "***"


def is_secret_key(key: Any) -> bool:
    """Whether values under ``key`` are secrets (``api_key``, ``admin_api_key``, ``hf_token``, ...)."""
    return SECRET_KEY.search(str(key).lower()) is not None


def redact(obj: Any) -> Any:
    """Replace values whose key looks secret (``api_key``, ``hf_token``, ...) with ``"***"`` (recursively)."""
    if isinstance(obj, dict):
        return {k: MASK if is_secret_key(k) and v else redact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def redact_url(url: str | None) -> str | None:
    """``url`` without user info (``http://user:pw@host`` -> ``http://host``)."""
    return None if url is None else re.sub(r"//[^/@]*@", "//", url)
