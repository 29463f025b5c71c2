"""The roofline bench (fluxlab/bench/roofline.py) on the CPU: its floors from LLaDA2.0-mini's shapes,
and which forwards it times as decode and commit forwards of a batch."""
from types import SimpleNamespace

import pytest

from fluxlab.bench.roofline import _num, decode_floor, experts_hit, forward_kind, serial_floor
from fluxlab.models.llada2.model import LLaDA2MoeConfig
from fluxlab.models.llada2.presets import PRESETS

CEILINGS = {"hbm_bytes_per_s": 4.0e12, "bf16_flops_per_s": 800e12}
H, V, EXPERT = 2048, 157184, 3 * 2048 * 512


@pytest.fixture(scope="module")
def mini():
    return LLaDA2MoeConfig.from_dict(dict(PRESETS["llada2_mini"]))


def test_routed_experts_stream_every_hit_expert_once(mini):
    # 2048 tokens x top-8 over 256 experts: every expert is hit; 19 MoE layers (layer 0 is dense)
    assert experts_hit(mini, 2048) == pytest.approx(256, abs=1e-6)
    stages = serial_floor(mini, 64, 32, 1024, 300, CEILINGS)
    assert stages["routed experts"] == pytest.approx(1e3 * 19 * 2 * 256 * EXPERT / 4.0e12)
    # one token hits its 8 experts only
    assert serial_floor(mini, 1, 1, 1, 300, CEILINGS)["routed experts"] == pytest.approx(
        1e3 * 19 * 2 * 8 * EXPERT / 4.0e12)


def test_lm_head_is_memory_bound_at_batch_1_and_compute_bound_at_batch_64(mini):
    small = serial_floor(mini, 1, 32, 16, 300, CEILINGS)["lm head"]
    big = serial_floor(mini, 64, 32, 1024, 300, CEILINGS)["lm head"]
    assert small == pytest.approx(1e3 * 2 * V * H / 4.0e12)
    assert big == pytest.approx(1e3 * 2 * V * H * 1024 / 800e12)


def test_serial_floor_adds_the_stages_and_exceeds_the_larger_of_the_totals_at_batch_64(mini):
    f = decode_floor(mini, 64, 32, 300, CEILINGS)
    assert f["serial_floor_ms"] == pytest.approx(sum(f["serial_stages_ms"].values()))
    # batch 64: the experts stream weights while the GEMMs are compute-bound, so they add up
    assert f["serial_floor_ms"] > 1.2 * f["floor_ms"]
    # the decode forward sends half the block's rows through the lm_head, the commit forward all of
    # them and twice the rows through the layers
    assert f["serial_stages_ms"]["lm head"] == pytest.approx(1e3 * 2 * V * H * 64 * 16 / 800e12)
    assert f["commit_serial_floor_ms"] > f["serial_floor_ms"]
    grow = [decode_floor(mini, b, 32, 300, CEILINGS)["serial_floor_ms"] for b in (1, 16, 64)]
    assert grow == sorted(grow)


def test_decode_floor_keeps_issue_7s_definition(mini):
    # the larger of (touched weights + cached K/V) / bandwidth and FLOPs / peak
    f = decode_floor(mini, 1, 32, 300, CEILINGS)
    attn = H * (16 + 8) * 128 + 16 * 128 * H
    hit = experts_hit(mini, 32)
    weights = 20 * attn + 3 * H * 5120 + 19 * (EXPERT + hit * EXPERT + H * 256) + V * H
    kv = 300 * 20 * 2 * 4 * 128 * 2
    assert f["memory_ms"] == pytest.approx(1e3 * (2 * weights + kv) / 4.0e12)
    assert f["floor_ms"] == max(f["memory_ms"], f["compute_ms"])


def _rows(*uncached: int) -> list:
    return [SimpleNamespace(active_block=5 + u, num_cached_blocks=5) for u in uncached]


def test_forward_kind_times_only_the_whole_batch_in_one_phase():
    assert forward_kind(_rows(0, 0, 0), 0, 3) == "decode"
    assert forward_kind(_rows(1, 1, 1), 0, 3) == "commit"
    assert forward_kind(_rows(0, 1, 0), 0, 3) == "other"  # rows prefilled in different forwards
    assert forward_kind(_rows(0, 0), 1, 3) == "other"  # one still waiting
    # the first rows finished: a smaller batch's forward must not count as this batch's
    assert forward_kind(_rows(0, 0), 0, 3) == "other"
    assert forward_kind([], 0, 3) == "other"
    # no forward of a kind: the tables print '-' instead of failing the variant
    assert (_num(None), _num(12.345), _num(108.94, 1)) == ("-", "12.35", "108.9")


def test_floors_read_a_dense_family_without_shared_experts():
    """SDAR-8B (dense, no shared experts): every stage is a bf16 GEMM streaming its weights at batch 1,
    so the serial floor is the weight bytes over the bandwidth, as the max floor is."""
    from fluxlab.models.sdar.model import SDARConfig
    from fluxlab.models.sdar.presets import preset_config

    c = SDARConfig.from_dict(dict(preset_config("sdar_8b")))
    assert experts_hit(c, 64) == 0.0
    f = decode_floor(c, 1, 4, 512, CEILINGS)
    stages = serial_floor(c, 1, 4, 4, 512, CEILINGS)
    assert stages["routed experts"] == 0.0 and stages["router + shared experts"] == 0.0
    attn = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096
    params = 36 * (attn + 3 * 4096 * 12288) + 151936 * 4096
    kv = 512 * 36 * 2 * 8 * 128 * 2
    assert f["memory_ms"] == pytest.approx(1e3 * (2 * params + kv) / 4.0e12)
    assert sum(stages.values()) == pytest.approx(f["memory_ms"], rel=1e-9)


def test_fp8_pages_halve_the_kv_share_of_the_floors(mini):
    two, one = decode_floor(mini, 64, 32, 4096, CEILINGS), decode_floor(mini, 64, 32, 4096, CEILINGS, kv_bytes=1)
    kv = 64 * 4096 * mini.num_hidden_layers * 2 * mini.num_key_value_heads * mini.head_dim  # values read
    assert two["memory_ms"] - one["memory_ms"] == pytest.approx(1e3 * kv / 4.0e12)
    assert two["serial_stages_ms"]["attention"] > one["serial_stages_ms"]["attention"]


def test_fp8_weights_halve_the_quantized_bytes_and_double_their_rate(mini):
    bf16, fp8 = serial_floor(mini, 1, 1, 1, 300, CEILINGS), serial_floor(mini, 1, 1, 1, 300, CEILINGS, fp8_weights=True)
    # batch 1 streams weights: the experts' and projections' bytes halve, the router and lm_head stay bf16
    assert fp8["routed experts"] == pytest.approx(bf16["routed experts"] / 2)
    assert fp8["attention projections"] == pytest.approx(bf16["attention projections"] / 2)
    assert fp8["lm head"] == bf16["lm head"]
    # batch 64 x 32 rows: the projections are compute-bound; e4m3 MMAs at twice the rate halve them too
    big, big8 = (serial_floor(mini, 64, 32, 1024, 300, CEILINGS, fp8_weights=q) for q in (False, True))
    assert big8["attention projections"] == pytest.approx(big["attention projections"] / 2)
    f, f8 = decode_floor(mini, 1, 32, 300, CEILINGS), decode_floor(mini, 1, 32, 300, CEILINGS, fp8_weights=True)
    plain = 2 * (19 * H * 256 + V * H)  # router + lm_head bytes
    assert f8["memory_ms"] == pytest.approx((f["memory_ms"] - 1e3 * plain / 4.0e12) / 2 + 1e3 * plain / 4.0e12,
                                            rel=0.02)  # the K/V bytes (small here) do not halve
