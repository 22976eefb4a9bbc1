"""The ``openai`` engine's loaded fingerprint, for the sglang servers it manages (``managed=true``).

Each checkpoint tensor is read back with the server's ``POST /get_weights_by_name`` (sglang's, every row asked
for) and fingerprinted as the in-process ``sglang`` engine does (:mod:`daskgen.engines.sglang.fingerprint`: the
same names compared, the same conversion back to the published dtype).  A server given by ``base_url`` is not
daskgen's and does not serve the ``policy_fingerprint`` feature (as it does not serve ``refresh``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from daskgen.engines.base import started
from daskgen.errors import RefreshError


class ServerFingerprint:
    """The engine method of the managed server's loaded fingerprint (mixed into the ``openai`` engine)."""

    name: str
    model: str
    _http: Any
    _server: Any

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint of each tensor named in ``dtypes`` as the managed server holds it."""
        from daskgen.engines.sglang.fingerprint import ALL_ROWS, fingerprint_of_values, unsliceable

        if self._server is None:
            raise RefreshError("openai engine: only a managed server's weights are read back (managed=true)")
        http, out, skipped = started(self.name, self._http), {}, unsliceable(self.model)
        for name, dtype in dtypes.items():
            if any(part in name for part in skipped):
                continue
            values = await http.post_json("/get_weights_by_name", {"name": name, "truncate_size": ALL_ROWS}, False)
            if (found := await asyncio.to_thread(fingerprint_of_values, values, dtype)) is not None:
                out[name] = found
        return out
