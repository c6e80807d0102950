"""Scheduling is a pure function of host-known sizes: test its contract on the CPU."""

import pytest

from mla import schedule
from mla.target import spec_for_name

H200 = spec_for_name("sm_90a", num_sms=132)


def splits(batch, kv_len, **kw):
    cfg = schedule.decode_config(H200, kv_format=kw.pop("kv_format", "bf16"))
    return schedule.choose_num_splits(
        batch=batch, total_kv=batch * kv_len, num_sms=132, ctas_per_sm=schedule.ctas_per_sm(H200, cfg), block_n=cfg.block_n, **kw
    )


@pytest.mark.parametrize("batch,kv_len", [(b, kv) for b in (1, 4, 32, 64, 256, 1024) for kv in (1, 64, 1024, 8192, 32768)])
def test_split_count_is_bounded_and_useful(batch, kv_len):
    n = splits(batch, kv_len)
    assert 1 <= n <= schedule.MAX_SPLITS
    assert n <= max(1, -(-kv_len // 64)), "never more splits than KV tiles"


def test_small_batches_split_to_fill_the_gpu_and_large_ones_do_not():
    assert splits(4, 8192) >= 16, "4 sequences must spread over many SMs"
    assert splits(256, 8192) == 1, "256 sequences already fill 132 SMs: no combine kernel"
    assert splits(4, 8192) > splits(64, 8192) >= splits(256, 8192)


def test_degenerate_sizes():
    assert schedule.choose_num_splits(batch=0, total_kv=0, num_sms=132, ctas_per_sm=2, block_n=64) == 1
    assert schedule.choose_num_splits(batch=5, total_kv=0, num_sms=132, ctas_per_sm=2, block_n=64) == 1


def test_configs_fit_the_target_memory():
    for spec in (H200, spec_for_name("gfx942")):
        for cfg in schedule.kernel_variants(spec):
            if hasattr(cfg, "shared_bytes"):
                assert cfg.shared_bytes <= spec.smem_bytes, f"{cfg.name} needs {cfg.shared_bytes} B on {spec.name}"


def test_variant_names_are_unique():
    names = [cfg.name for cfg in schedule.kernel_variants(H200)]
    assert len(names) == len(set(names))


def test_op_layer_dims_match_the_kernels():
    """mla.constants (TileLang-free, for mla.ops) and the kernel layer must agree on every shape."""
    from mla import constants
    from tl_kernels import mla_decode

    assert (constants.KV_LORA_RANK, constants.ROPE_DIM, constants.QK_DIM) == (
        mla_decode.KV_LORA_RANK,
        mla_decode.ROPE_DIM,
        mla_decode.QK_DIM,
    )
    assert {q for _, q in constants.MODES.values()} <= set(mla_decode.Q_FORMATS)
    assert {kv for kv, _ in constants.MODES.values()} == set(mla_decode.KV_FORMATS)
