"""The engine registry (entry points) and the capabilities every engine declares on the base class."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from daskgen.engines import available_engines, create_engine, get_engine_class
from daskgen.engines.base import Engine, GenerationRequest, GenerationResult
from daskgen.errors import EngineNotFoundError

BUILTIN = {"transformers", "simulated", "sglang", "openai"}
CAPABILITIES = {
    "supports_seed": False,
    "sleep_supported": False,
    "retokenized": False,
    "eos_token_ids": frozenset(),
    "max_total_tokens": None,
    "vocab_size": None,
}


def test_builtins_come_from_the_entry_points_once() -> None:
    assert set(available_engines()) >= BUILTIN
    assert get_engine_class("simulated").__name__ == "SimulatedEngine"
    with pytest.raises(EngineNotFoundError, match="registered engines are"):
        get_engine_class("no-such-engine")


def test_duplicate_engine_name_warns_and_first_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "rogue_engines-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rogue-engines\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[daskgen.engines]\nsimulated = rogue.module:Engine\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # after daskgen's own registration
    with pytest.warns(RuntimeWarning, match="'simulated' is registered twice.*rogue.module:Engine"):
        cls = get_engine_class("simulated")
    assert cls.__name__ == "SimulatedEngine"


class _BareEngine(Engine):
    """An engine that overrides no capability (it is never started)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError


def test_capabilities_are_declared_on_the_base_class() -> None:
    bare = _BareEngine("m")
    for name, default in CAPABILITIES.items():
        assert name in vars(Engine) and getattr(bare, name) == default, name
    for name in BUILTIN:
        cls = get_engine_class(name)
        for capability in CAPABILITIES:
            assert hasattr(cls, capability), (name, capability)
    engine = create_engine("simulated", "m", vocab_size=100, eos_token_id=7)
    assert engine.supports_seed and engine.eos_token_ids == {7} and engine.vocab_size == 100
    assert engine.max_total_tokens is None and not engine.sleep_supported and not engine.retokenized
    openai = create_engine("openai", "m", base_url="http://127.0.0.1:1")
    assert not openai.supports_seed and openai.vocab_size is None and openai.max_total_tokens is None
    assert "vocab_size" not in vars(openai)  # the class default until start
