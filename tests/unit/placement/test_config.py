"""Placement configs: defaults, immutability, validation and loading from mappings and files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig, load_placement_config

GiB = 2**30
MiB = 2**20

CONFIG_CLASSES = [StaticPlacementConfig, AutoPlacementConfig]


def _field_errors(exc: pytest.ExceptionInfo[pydantic.ValidationError]) -> list[dict[str, Any]]:
    return exc.value.errors()


def _assert_names_field(exc: pytest.ExceptionInfo[pydantic.ValidationError], field: str) -> None:
    errors = _field_errors(exc)
    assert errors, "a ValidationError with no errors"
    assert all(field in e["loc"] for e in errors), f"expected every error to point at {field!r}, got {errors}"


# --- defaults ---------------------------------------------------------------------------------


def test_static_defaults() -> None:
    cfg = StaticPlacementConfig()
    assert cfg.policy == "static"
    assert cfg.shard_param_frac == 1.0
    assert cfg.offload_param_frac == 0.0
    assert cfg.offload_optim_frac == 0.0
    assert cfg.max_prefetch == 2  # chosen by measurement (the field documents it)
    assert cfg.device_budget is None


def test_auto_defaults() -> None:
    cfg = AutoPlacementConfig()
    assert cfg.policy == "auto"
    assert cfg.device_budget is None
    assert cfg.max_prefetch == 0
    assert cfg.warmup_non_model_data_ratio == 0.8
    assert cfg.steady_device_cap_ratio == 0.9


# --- frozen, closed ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (StaticPlacementConfig, "shard_param_frac", 0.5),
        (StaticPlacementConfig, "max_prefetch", 2),
        (StaticPlacementConfig, "device_budget", 1024),
        (AutoPlacementConfig, "max_prefetch", 2),
        (AutoPlacementConfig, "steady_device_cap_ratio", 0.5),
        (AutoPlacementConfig, "device_budget", 1024),
    ],
)
def test_frozen(cls: type[pydantic.BaseModel], field: str, value: object) -> None:
    cfg = cls()
    before = getattr(cfg, field)
    with pytest.raises(pydantic.ValidationError) as exc:
        setattr(cfg, field, value)
    _assert_names_field(exc, field)
    assert getattr(cfg, field) == before


def test_frozen_configs_are_hashable_and_compare_by_value() -> None:
    assert StaticPlacementConfig(max_prefetch=2) == StaticPlacementConfig(max_prefetch=2)
    assert hash(AutoPlacementConfig(device_budget="1GiB")) == hash(AutoPlacementConfig(device_budget=GiB))


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
def test_unknown_keys_refused(cls: type[pydantic.BaseModel]) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        cls(max_prefetchh=1)
    errors = _field_errors(exc)
    assert [e["type"] for e in errors] == ["extra_forbidden"]
    assert errors[0]["loc"] == ("max_prefetchh",)


def test_unknown_key_of_the_other_policy_refused() -> None:
    # A static-only field on the auto config (and vice versa) is an unknown key, not ignored.
    with pytest.raises(pydantic.ValidationError) as exc:
        AutoPlacementConfig(shard_param_frac=0.5)
    assert exc.value.errors()[0]["loc"] == ("shard_param_frac",)
    with pytest.raises(pydantic.ValidationError) as exc:
        StaticPlacementConfig(steady_device_cap_ratio=0.5)
    assert exc.value.errors()[0]["loc"] == ("steady_device_cap_ratio",)


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
def test_policy_literal_cannot_be_swapped(cls: type[pydantic.BaseModel]) -> None:
    other = "auto" if cls is StaticPlacementConfig else "static"
    with pytest.raises(pydantic.ValidationError) as exc:
        cls(policy=other)
    _assert_names_field(exc, "policy")


# --- range checks -----------------------------------------------------------------------------

FRACTIONS = ["shard_param_frac", "offload_param_frac", "offload_optim_frac"]


@pytest.mark.parametrize("field", FRACTIONS)
@pytest.mark.parametrize("value", [-0.01, -1.0, 1.0001, 2.0])
def test_static_fraction_out_of_range(field: str, value: float) -> None:
    # offload_param_frac is only valid with full sharding and optimizer offload; give those so that
    # the only complaint is the range.
    kwargs: dict[str, Any] = {field: value}
    if field == "offload_param_frac":
        kwargs.update(shard_param_frac=1.0, offload_optim_frac=1.0)
    with pytest.raises(pydantic.ValidationError) as exc:
        StaticPlacementConfig(**kwargs)
    _assert_names_field(exc, field)


@pytest.mark.parametrize("field", FRACTIONS)
@pytest.mark.parametrize("value", [0.0, 0.25, 1.0])
def test_static_fraction_in_range(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    if field == "offload_param_frac":
        kwargs.update(shard_param_frac=1.0, offload_optim_frac=1.0)
    assert getattr(StaticPlacementConfig(**kwargs), field) == value


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
def test_max_prefetch_range(cls: type[pydantic.BaseModel]) -> None:
    assert cls(max_prefetch=0).max_prefetch == 0
    assert cls(max_prefetch=7).max_prefetch == 7
    with pytest.raises(pydantic.ValidationError) as exc:
        cls(max_prefetch=-1)
    _assert_names_field(exc, "max_prefetch")


@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 1.5])
def test_warmup_ratio_is_open_interval(value: float) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        AutoPlacementConfig(warmup_non_model_data_ratio=value)
    _assert_names_field(exc, "warmup_non_model_data_ratio")


@pytest.mark.parametrize("value", [1e-6, 0.5, 0.999999])
def test_warmup_ratio_accepted(value: float) -> None:
    assert AutoPlacementConfig(warmup_non_model_data_ratio=value).warmup_non_model_data_ratio == value


@pytest.mark.parametrize("value", [0.0, -0.1, 1.0001, 2.0])
def test_steady_ratio_is_half_open_interval(value: float) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        AutoPlacementConfig(steady_device_cap_ratio=value)
    _assert_names_field(exc, "steady_device_cap_ratio")


@pytest.mark.parametrize("value", [1e-6, 0.5, 1.0])
def test_steady_ratio_accepted(value: float) -> None:
    assert AutoPlacementConfig(steady_device_cap_ratio=value).steady_device_cap_ratio == value


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
@pytest.mark.parametrize("value", [0, -1, -(2**40), "0B", "0GiB"])
def test_device_budget_must_be_positive(cls: type[pydantic.BaseModel], value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        cls(device_budget=value)
    _assert_names_field(exc, "device_budget")


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
@pytest.mark.parametrize("value", ["lots", "3 parsecs", "GiB", [1]])
def test_device_budget_garbage_refused(cls: type[pydantic.BaseModel], value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        cls(device_budget=value)
    _assert_names_field(exc, "device_budget")


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (600_000, 600_000),
        ("3GiB", 3 * GiB),
        ("512MiB", 512 * MiB),
        ("1 KiB", 1024),
        ("1.5GiB", 3 * GiB // 2),
        (str(12345), 12345),
        (2e9, 2_000_000_000),
        ("2e9", 2_000_000_000),
    ],
)
def test_device_budget_parses(cls: type[pydantic.BaseModel], value: object, expected: int) -> None:
    budget = cls(device_budget=value).device_budget
    assert budget == expected
    assert int(budget) == expected
    assert isinstance(budget, int)


# --- cross-field rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shard", "optim"),
    [(1.0, 0.0), (0.5, 1.0), (1.0, 0.99), (0.0, 0.0), (0.999, 1.0)],
)
def test_param_offload_needs_full_shard_and_optim_offload(shard: float, optim: float) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        StaticPlacementConfig(offload_param_frac=0.5, shard_param_frac=shard, offload_optim_frac=optim)
    assert "offload_param_frac" in str(exc.value)
    messages = " ".join(e["msg"] for e in exc.value.errors())
    assert "offload_param_frac" in messages


@pytest.mark.parametrize("frac", [1e-9, 0.5, 1.0])
def test_param_offload_accepted_with_full_shard_and_optim_offload(frac: float) -> None:
    cfg = StaticPlacementConfig(offload_param_frac=frac, shard_param_frac=1.0, offload_optim_frac=1.0)
    assert cfg.offload_param_frac == frac


@pytest.mark.parametrize(("shard", "optim"), [(0.0, 0.0), (0.5, 0.3), (1.0, 0.0)])
def test_zero_param_offload_needs_nothing(shard: float, optim: float) -> None:
    cfg = StaticPlacementConfig(offload_param_frac=0.0, shard_param_frac=shard, offload_optim_frac=optim)
    assert cfg.offload_param_frac == 0.0


# --- load_placement_config ----------------------------------------------------------------------

STATIC_DATA: dict[str, Any] = {
    "policy": "static",
    "shard_param_frac": 1.0,
    "offload_optim_frac": 1.0,
    "offload_param_frac": 0.5,
    "max_prefetch": 2,
    "device_budget": "3GiB",
}
AUTO_DATA: dict[str, Any] = {
    "policy": "auto",
    "device_budget": "512MiB",
    "max_prefetch": 1,
    "warmup_non_model_data_ratio": 0.5,
    "steady_device_cap_ratio": 0.75,
}
EXPECTED = {
    "static": StaticPlacementConfig(
        shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=0.5, max_prefetch=2, device_budget=3 * GiB
    ),
    "auto": AutoPlacementConfig(
        device_budget=512 * MiB, max_prefetch=1, warmup_non_model_data_ratio=0.5, steady_device_cap_ratio=0.75
    ),
}


@pytest.mark.parametrize("data", [STATIC_DATA, AUTO_DATA], ids=["static", "auto"])
def test_load_from_mapping(data: dict[str, Any]) -> None:
    cfg = load_placement_config(data)
    assert type(cfg) is type(EXPECTED[data["policy"]])
    assert cfg == EXPECTED[data["policy"]]


@pytest.mark.parametrize(("policy", "cls"), [("static", StaticPlacementConfig), ("auto", AutoPlacementConfig)])
def test_load_minimal_mapping_gives_defaults(policy: str, cls: type[pydantic.BaseModel]) -> None:
    cfg = load_placement_config({"policy": policy})
    assert type(cfg) is cls
    assert cfg == cls()


@pytest.mark.parametrize("cfg", [StaticPlacementConfig(max_prefetch=3), AutoPlacementConfig(device_budget=10)])
def test_load_passes_configs_through(cfg: StaticPlacementConfig | AutoPlacementConfig) -> None:
    assert load_placement_config(cfg) is cfg


@pytest.mark.parametrize("data", [STATIC_DATA, AUTO_DATA], ids=["static", "auto"])
@pytest.mark.parametrize("as_str", [False, True], ids=["path", "str"])
def test_load_from_json_file(tmp_path: Path, data: dict[str, Any], as_str: bool) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(data))
    cfg = load_placement_config(str(path) if as_str else path)
    assert type(cfg) is type(EXPECTED[data["policy"]])
    assert cfg == EXPECTED[data["policy"]]


@pytest.mark.parametrize("data", [STATIC_DATA, AUTO_DATA], ids=["static", "auto"])
@pytest.mark.parametrize("name", ["placement.yaml", "placement.yml", "PLACEMENT.YAML"])
def test_load_from_yaml_file(tmp_path: Path, data: dict[str, Any], name: str) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    cfg = load_placement_config(path)
    assert type(cfg) is type(EXPECTED[data["policy"]])
    assert cfg == EXPECTED[data["policy"]]


def test_load_yaml_handwritten(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("policy: auto\ndevice_budget: 3GiB\nmax_prefetch: 2\n")
    cfg = load_placement_config(path)
    assert isinstance(cfg, AutoPlacementConfig)
    assert cfg.device_budget == 3 * GiB
    assert cfg.max_prefetch == 2


@pytest.mark.parametrize("policy", ["belady", "Static", "AUTO", "", None, 3])
def test_load_wrong_policy_name(policy: object) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        load_placement_config({"policy": policy, "max_prefetch": 1})
    text = str(exc.value)
    assert "policy" in text
    if isinstance(policy, str):
        # A bad name names the accepted ones.
        assert "'static'" in text
        assert "'auto'" in text


def test_load_missing_policy() -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        load_placement_config({"max_prefetch": 1})
    assert "policy" in str(exc.value)


def test_load_wrong_policy_in_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"policy": "belady"}))
    with pytest.raises(pydantic.ValidationError, match="belady"):
        load_placement_config(path)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"policy": "static", "shard_param_frac": 1.5}, "shard_param_frac"),
        ({"policy": "static", "max_prefetch": -1}, "max_prefetch"),
        ({"policy": "auto", "device_budget": 0}, "device_budget"),
        ({"policy": "auto", "steady_device_cap_ratio": 0}, "steady_device_cap_ratio"),
        ({"policy": "auto", "offload_optim_frac": 1.0}, "offload_optim_frac"),
    ],
)
def test_load_invalid_content_names_field(tmp_path: Path, data: dict[str, Any], field: str) -> None:
    for source in (data, tmp_path / "p.json", tmp_path / "p.yaml"):
        if isinstance(source, Path):
            source.write_text(json.dumps(data) if source.suffix == ".json" else yaml.safe_dump(data))
        with pytest.raises(pydantic.ValidationError) as exc:
            load_placement_config(source)
        locs = [e["loc"] for e in exc.value.errors()]
        assert locs and all(field in loc for loc in locs), locs


def test_load_param_offload_rule_in_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"policy": "static", "offload_param_frac": 0.5}))
    with pytest.raises(pydantic.ValidationError, match="offload_param_frac"):
        load_placement_config(path)


@pytest.mark.parametrize("name", ["placement.toml", "placement.txt", "placement", "placement.json.bak", "p.ini"])
def test_load_bad_suffix(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(json.dumps(STATIC_DATA))
    with pytest.raises(ValueError, match=r"\.json, \.yaml or \.yml") as exc:
        load_placement_config(path)
    assert not isinstance(exc.value, pydantic.ValidationError)
    assert name in str(exc.value)


@pytest.mark.parametrize("content", ["- policy: static\n", "just a string\n", "42\n", ""])
def test_load_yaml_not_a_mapping(tmp_path: Path, content: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_placement_config(path)


def test_load_missing_file_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_placement_config(tmp_path / "missing.json")


@pytest.mark.parametrize("cls", [StaticPlacementConfig, AutoPlacementConfig])
@pytest.mark.parametrize("field", ["max_prefetch", "device_budget"])
def test_bools_are_not_numbers(cls: type, field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as error:
        cls(**{field: True})
    assert error.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
@pytest.mark.parametrize("value", [1.5, "1.5", 0.25])
def test_a_fractional_byte_count_is_refused_with_the_unit(cls: type[pydantic.BaseModel], value: object) -> None:
    """``1.5`` used to be refused as "could not parse value and unit", and ``"1.5"`` became 1 byte."""
    with pytest.raises(pydantic.ValidationError, match=r"counts bytes, so it must be whole.*GiB'") as exc:
        cls(device_budget=value)
    _assert_names_field(exc, "device_budget")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("dup.yaml", "policy: static\npolicy: auto\n"),
        ("dup.yml", "policy: auto\ndevice_budget: 1GiB\nmax_prefetch: 1\ndevice_budget: 2GiB\n"),
        ("dup.json", '{"policy": "static", "policy": "auto"}'),
    ],
)
def test_a_key_given_twice_in_a_file_is_refused(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=r"twice"):
        load_placement_config(path)


# --- what pydantic's ByteSize misreads (it parses a prefix: "2,048MiB" was 2 bytes) -------------


@pytest.mark.parametrize("field", ["device_budget", "host_budget"])
@pytest.mark.parametrize("value", ["2,048MiB", "1,5GiB", "1_000MiB", "2 048MiB", "1'000MiB"])
def test_a_budget_with_a_digit_separator_is_refused_naming_field_and_value(field: str, value: str) -> None:
    """A comma is a thousands separator in some locales and a decimal point in others: refused,
    not read as the digits before it."""
    with pytest.raises(pydantic.ValidationError) as exc:
        StaticPlacementConfig(**{field: value})
    _assert_names_field(exc, field)
    message = exc.value.errors()[0]["msg"]
    assert f"{field}={value!r}" in message and "separator" in message


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", float("nan"), float("inf")])
def test_a_budget_that_is_not_a_number_is_refused_as_such(value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        AutoPlacementConfig(host_budget=value)
    _assert_names_field(exc, "host_budget")
    message = exc.value.errors()[0]["msg"]
    assert "not a number of bytes" in message
    assert "nanGiB" not in message and "infGiB" not in message


@pytest.mark.parametrize("value", ["3GiB!", "3 GiB extra", "3..5GiB", "1e3GiB", "3 parsecs"])
def test_a_budget_string_is_read_whole(value: str) -> None:
    """Text after the number and unit used to be ignored ("3GiB!" was 3 GiB, "3..5GiB" 3 bytes)."""
    with pytest.raises(pydantic.ValidationError) as exc:
        StaticPlacementConfig(device_budget=value)
    _assert_names_field(exc, "device_budget")
