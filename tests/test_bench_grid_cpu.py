"""bench.py's ``--grid HEADSxQ_LEN,...`` (issue 17's whole table in one run), ``--rows`` and the TFLOP/s column, on the
CPU: parsing, the flop count, the rows and tables it prints, and the kernels a grid run would compile."""

import argparse

import pytest

import bench
import mla.prebuild
from mla.target import spec_for_name
from mla_bench import measure, report, timing
from mla_bench.cases import (Case, at_point, build_cases, bytes_moved, flops_of, grid_points, mode_overrides,
                             parse_grid, selected_kernels)
from mla_bench.report import format_row, grid_table
from mla_bench.run import compile_only
from tl_kernels.mla_decode_rows import RowsDecodeKernelConfig


def test_parse_grid():
    assert parse_grid("128x4,128x1, 64x1,16x4,16x8") == [(128, 4), (128, 1), (64, 1), (16, 4), (16, 8)]
    assert parse_grid("16X2,16x2") == [(16, 2)]  # case-insensitive, duplicates dropped


@pytest.mark.parametrize("bad", ["", "128", "128x", "12x4", "128x0", "axb", "128x4x2"])
def test_parse_grid_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_grid(bad)


def test_command_line_grid_and_points():
    args = bench.parse_args(["--grid", "128x4,64x1", "--rows", "--shapes", "32x8192"])
    assert args.grid == [(128, 4), (64, 1)] and args.rows
    assert grid_points(args) == [(128, 4), (64, 1)]
    sub = at_point(args, 64, 1)
    assert (sub.heads, sub.q_len, args.heads, args.q_len) == (64, 1, 16, 1)
    plain = bench.parse_args(["--heads", "128", "--q-len", "2"])
    assert plain.grid is None and not plain.rows and grid_points(plain) == [(128, 2)]
    assert mode_overrides(plain) is None and mode_overrides(args) == {"rows": True}
    with pytest.raises(SystemExit):
        bench.parse_args(["--grid", "100x1"])


def test_flops():
    # issue 17: 256 x 8192 at 128 heads x q_len 4 is 2.34 TFLOP
    assert flops_of(256, 8192, 4, 128) == pytest.approx(2.336e12, rel=1e-3)
    assert flops_of(1, 1, 1, 1) == 2 * (576 + 512)


def test_measure_adds_tflops_and_format_prints_it(monkeypatch):
    monkeypatch.setattr(timing, "time_call_us", lambda fn, **_: [1000.0, 1000.0, 1000.0])
    args = argparse.Namespace(q_len=4, heads=128, reps=3, check=False)
    b = measure.Bench(args=args, spec=None, device="cpu", flush=None, ceiling_gbps=4000.0, peers=[])
    case = Case("256x8192", (8192,) * 256)
    row = measure.measure(b, measure.base_row(case, "bf16", "mode", args), lambda: None, reps=3,
                          bytes_read=bytes_moved(256, 8192, 4, 128, "bf16"))
    assert row["tflops"] == pytest.approx(2336.0, rel=1e-3)  # 2.336 TFLOP in 1 ms
    assert "TFLOP/s" in format_row(row)


@pytest.mark.parametrize("times,spread", [
    ([100.0] * 20, 0.0),
    ([100.0 + i for i in range(11)], 100.0 * (109 - 101) / 105),  # 11 reps: p10 and p90 are the 2nd and 10th
    ([50.0] + [100.0] * 8 + [400.0], 100.0 * (130 - 95) / 100),  # 10 reps: deciles interpolated (inclusive)
    ([30.0 + 10 * i for i in range(10)], 100.0 * (111 - 39) / 75),
    ([7.0], 0.0),
])
def test_spread_is_p90_minus_p10_over_the_median(times, spread):
    assert timing.spread_pct(times) == pytest.approx(spread)


def test_noisy_measurements_are_flagged(monkeypatch, capsys):
    """A measurement whose reps spread past NOISY_SPREAD_PCT says so on its line and in the summary; a steady one
    does not (run 57: the reps of one call swung from 33 to 420 us on a disturbed host)."""
    reps = {"steady": [100.0, 101.0, 99.0, 100.0, 100.5], "noisy": [33.0, 76.0, 41.0, 420.0, 38.0, 60.0, 35.0]}
    args = argparse.Namespace(q_len=1, heads=16, reps=7, check=False)
    b = measure.Bench(args=args, spec=None, device="cpu", flush=None, ceiling_gbps=4000.0, peers=[])
    rows = []
    for impl, times in (("bf16", reps["steady"]), ("fp8", reps["noisy"])):
        monkeypatch.setattr(timing, "time_call_us", lambda fn, times=times, **_: list(times))
        case = Case("4x1024", (1024,) * 4)
        rows.append(measure.measure(b, measure.base_row(case, impl, "mode", args), lambda: None, reps=len(times),
                                    bytes_read=bytes_moved(4, 1024, 1, 16, impl)))
    assert rows[0]["spread_pct"] < timing.NOISY_SPREAD_PCT < rows[1]["spread_pct"]
    assert "NOISY" not in format_row(rows[0]) and "NOISY" in format_row(rows[1])
    assert report.noisy_rows(rows) == ["4x1024/fp8"]
    report.print_summary(rows, [Case("4x1024", (1024,) * 4)], 4000.0, args)
    assert "NOISY timings" in capsys.readouterr().out


def fake_row(impl, heads, q_len, label, time_us):
    return {"case": label, "impl": impl, "kind": "mode" if impl == "bf16" else "peer", "heads": heads,
            "q_len": q_len, "time_us": time_us, "tflops": 100.0, "gbps": 1.0, "pct_ceiling": 1.0}


def test_grid_table_one_line_per_point_and_shape():
    cases = [Case("32x8192", (8192,) * 32), Case("256x8192", (8192,) * 256)]
    rows = [fake_row("bf16", h, q, c.label, 10.0 * h * q) for h, q in ((128, 4), (64, 1)) for c in cases]
    rows.append(fake_row("fa3", 128, 4, "32x8192", 482.0))
    lines = grid_table(rows, cases, [(128, 4), (64, 1)])
    assert len(lines) == 1 + 2 * 2
    assert "bf16 us (TFLOP/s)" in lines[0] and "fa3 us (TFLOP/s)" in lines[0]
    assert lines[1].split()[:2] == ["128x4", "32x8192"] and "5120.0 (100)" in lines[1] and "482.0 (100)" in lines[1]
    assert lines[4].split()[:2] == ["64x1", "256x8192"] and lines[4].rstrip().endswith("-")  # no fa3 row there


def test_compile_only_covers_every_grid_point(monkeypatch):
    """Without a GPU, a grid run compiles what each point would launch; with --rows the 64-row kernels."""
    built = []

    def build(configs, spec, **_):
        built.extend(configs)
        return [mla.prebuild.BuildResult(cfg.name, 0.0, None) for cfg in configs]

    monkeypatch.setattr(mla.prebuild, "build", build)
    args = bench.parse_args(["--grid", "128x4,64x1,16x1", "--rows", "--modes", "bf16", "--shapes", "32x8192",
                             "--host-shape", "none"])
    assert compile_only(args, build_cases(args)) == 0
    rows_cfgs = [c for c in built if isinstance(c, RowsDecodeKernelConfig)]
    assert {(c.num_heads, c.q_slots) for c in rows_cfgs} == {(128, 4), (64, 1)}
    assert any(getattr(c, "num_heads", None) == 16 for c in built), "16 heads x 1 query: the 16-row class"


def test_selected_kernels_follow_rows_flag():
    spec = spec_for_name("sm_90a")
    case = Case("32x8192", (8192,) * 32)
    on = at_point(bench.parse_args(["--rows"]), 128, 4)
    off = at_point(bench.parse_args([]), 128, 4)
    assert isinstance(selected_kernels(spec, "bf16", case, on)[0], RowsDecodeKernelConfig)
    assert not isinstance(selected_kernels(spec, "bf16", case, off)[0], RowsDecodeKernelConfig)
