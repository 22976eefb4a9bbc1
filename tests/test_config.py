import pytest

from daskgen.config import RunConfig
from daskgen.errors import ConfigError


def test_yaml_with_flag_overrides(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("model: m\nn_samples: 4\ntemperature: 0.5\nengine_args: {device: cpu}\n")
    cfg = RunConfig.load(cfg_file, n_samples=2, top_p=None)
    assert (cfg.model, cfg.n_samples, cfg.temperature, cfg.top_p) == ("m", 2, 0.5, 1.0)
    assert cfg.engine_args == {"device": "cpu"}


def test_unknown_key_lists_valid_keys(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("modle: m\n")
    with pytest.raises(ConfigError) as err:
        RunConfig.load(cfg_file)
    assert "'modle'" in str(err.value) and "did you mean 'model'" in str(err.value)
    assert "max_new_tokens" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("n_samples", "3", "must be int"),
        ("n_samples", 0, ">= 1"),
        ("temperature", -1.0, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("logprobs", "yes", "must be bool"),
    ],
)
def test_bad_values_are_named(key, value, fragment):
    with pytest.raises(ConfigError, match=key if key != "top_p" else "top_p") as err:
        RunConfig(**{key: value})
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "expected", "fix"),
    [
        (
            "top_logprobs",
            -1,
            "it must be an integer >= 0 (the k most likely tokens",
            "Give 0 or more (--top-logprobs K)",
        ),
        ("max_retries", -1, "it must be an integer >= 0 (retries of a failed partition", "(--max-retries N)"),
        ("top_logprobs", True, "must be int, found bool True", "give it a value of type int"),
    ],
)
def test_negative_counts_are_refused_naming_found_expected_and_fix(key, value, expected, fix):
    with pytest.raises(ConfigError) as err:
        RunConfig(**{key: value})
    text = str(err.value)
    assert text.startswith(f"setting {key!r} "), text
    assert str(value) in text and expected in text and fix in text, text
    assert RunConfig(**{key: 0}) is not None  # the edge passes


def test_missing_required_names_flags():
    with pytest.raises(ConfigError, match="--store"):
        RunConfig(model="m").require("model", "store")


def test_yaml_must_be_a_mapping(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        RunConfig.load(cfg_file)
