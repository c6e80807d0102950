"""The GPU tools' argument parsing, on the CPU: what a device call's command line turns into."""

import pytest

from tools.override_ab import BOOL_FIELDS, parse_variants
from tools.profile_call import parse_cases


def test_override_variants_take_every_bool_config_field_as_a_bool():
    """``fp8_mma=1`` must build the config ``fp8_mma=True`` builds (same name and cache key), for every bool field
    of the kernel configs; other fields stay ints."""
    (name, ov), (name2, ov2) = parse_variants("dyn:ws=1,fp8_mma=1,dynamic_stage=1,num_stages=3;plain:")
    assert (name, name2, ov2) == ("dyn", "plain", {})
    assert ov == {"ws": True, "fp8_mma": True, "dynamic_stage": True, "num_stages": 3}
    assert all(type(v) is bool for k, v in ov.items() if k != "num_stages") and type(ov["num_stages"]) is int
    assert {"dynamic_stage", "p_stack", "fast_decode", "split", "ws"} <= BOOL_FIELDS
    assert "num_stages" not in BOOL_FIELDS and "vt_stages" not in BOOL_FIELDS


def test_profile_cases_parse_mode_shape_and_overrides():
    cases = parse_cases('fp8:32x8192; a8w8:4x1024:{"ws": true, "num_splits_hint": 2};flashmla-fp8:256x1024;')
    assert cases == [("fp8", 32, 8192, None), ("a8w8", 4, 1024, {"ws": True, "num_splits_hint": 2}),
                     ("flashmla-fp8", 256, 1024, None)]
    with pytest.raises(ValueError):
        parse_cases("fp8:32by8192")
