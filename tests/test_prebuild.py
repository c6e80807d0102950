"""``python -m mla.prebuild`` on the CPU: the variants it enumerates are exactly those the op's calls may use (every
one is picked by some call, no call picks one it lacks), its options are checked with errors naming the option,
``--list`` compiles nothing, and one small variant (the combine kernel: a few seconds) goes end to end into a cache
directory that a fresh process without nvcc then loads from (skipped without nvcc)."""

import itertools
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from tl_kernels.mla_schedule import SplitScheduleConfig

from mla import prebuild, schedule
from mla.constants import MODES
from mla.target import spec_for_name

H200 = spec_for_name("sm_90a")
GFX942 = spec_for_name("gfx942")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def scratch():
    """A temporary directory removed after the test whatever its outcome (pytest's tmp_path keeps the last three
    runs' under /tmp: the suite leaves nothing behind)."""
    with tempfile.TemporaryDirectory(prefix="mla_prebuild_test_") as path:
        yield pathlib.Path(path)


def names(configs):
    return [cfg.name for cfg in configs]


def listed(capsys, *argv):
    """``--list``'s stdout lines, after a successful exit."""
    assert prebuild.main([*argv, "--list"]) == 0
    return capsys.readouterr().out.splitlines()


def test_fp8_page64_heads16_is_what_the_issue_names():
    """The issue's example class: the split, direct and fused-merge decode kernels, the combine kernel,
    mla.flash_mla's FlashMLA-shaped one-launch kernel and its graph form (split kernel reading each sequence's
    split count, the combine's flash form, the split schedule); no warp-specialised kernel (fp8's default takes it
    for flat caches only: schedule.WS_DEFAULTS)."""
    got = names(prebuild.call_variants(H200, modes=["fp8"], page_sizes=[64], heads=[16]))
    assert got == [
        "mla_decode_split_kvfp8_qbf16_h16_bh16_qt1_bn64_st1_t128_g1_page64_fn",
        "mla_decode_direct_kvfp8_qbf16_h16_bh16_qt1_bn64_st1_t128_g1_page64_fn",
        "mla_combine_h16_t128",
        "mla_decode_split_kvfp8_qbf16_h16_bh16_qt1_bn64_st1_t128_g1_page64_fused_fn",
        "mla_decode_split_kvfp8_qbf16_h16_bh16_qt1_bn64_st1_t128_g1_page64_fused_flash_fn",
        "mla_decode_split_kvfp8_qbf16_h16_bh16_qt1_bn64_st1_t128_g1_page64_flash_counts_fn",
        "mla_combine_h16_t128_flash",
        "mla_combine_h16_t128_flash_l4",
        "mla_split_schedule_t256_c64",
    ]
    assert "fp8" in schedule.WS_FORMATS and schedule.WS_DEFAULTS["fp8"].paged_min_tokens is None


def test_flat_cache_default_class_matches_kernel_variants():
    """Flat cache, 16 heads, one query, every mode: the set bench.py and tests/test_compile.py build."""
    got = prebuild.call_variants(H200, modes=MODES, page_sizes=[0], heads=[16])
    assert sorted(names(got)) == sorted(names(schedule.kernel_variants(H200)))


@pytest.mark.parametrize("spec", [H200, GFX942], ids=lambda s: s.name)
def test_names_unique_and_in_order(spec):
    everything = prebuild.call_variants(spec, modes=MODES, page_sizes=prebuild.PAGE_SIZES, heads=[16, 32, 64, 128],
                                        q_lens=[1, 2, 3, 4, 8], causal=[False, True], a8w8_q="both")
    assert len(set(names(everything))) == len(everything)
    assert all(cfg.fp8_dtype.endswith("fnuz") == spec.is_hip for cfg in everything if hasattr(cfg, "fp8_dtype"))
    # Deterministic: the same command lists the same variants in the same order (a cache recipe is reproducible).
    again = prebuild.call_variants(spec, modes=MODES, page_sizes=prebuild.PAGE_SIZES, heads=[16, 32, 64, 128],
                                   q_lens=[1, 2, 3, 4, 8], causal=[False, True], a8w8_q="both")
    assert names(again) == names(everything)


# Problem sizes that reach every kernel select_kernels has for a class: one CTA per SM or fewer (fused merge), more
# (split + combine; for some classes only with a forced split count), one split (direct), and at least
# the largest schedule.WS_DEFAULTS min_tokens cached tokens (the warp-specialised kernel of WS_FORMATS).
BATCHES = (1, 8, 64, 1024)
KV_LENS = (1, 1000, 70000)
NUM_SPLITS = (None, 2)


def selected(spec, mode, heads, page, q_len, causal, *, flash=False):
    """Every kernel name select_kernels picks for the class over the size grid (with ``flash``: as mla.flash_mla
    runs it, causal dropped for one query token and the FlashMLA-shaped form where one exists)."""
    kv_format, q_format = MODES[mode]
    if flash:
        causal = causal and q_len > 1
    picked = set()
    for batch, kv_len, num_splits in itertools.product(BATCHES, KV_LENS, NUM_SPLITS):
        decode, combine, _ = schedule.select_kernels(
            spec, kv_format=kv_format, q_format=q_format, num_heads=heads, causal=causal, page_size=page,
            batch=batch, total_q=batch * q_len, total_kv=batch * kv_len, num_splits=num_splits)
        picked.add(decode.name)
        if combine is not None:
            picked.add(combine.name)
        if flash and schedule.flash_io_variant(decode) is not None:
            picked.add(schedule.flash_io_variant(decode).name)
    if q_format == "fp8" and schedule.amax_config(spec, num_heads=heads) is not None:
        picked.add(schedule.amax_config(spec, num_heads=heads).name)  # a8w8's reduction (the grid has unfused calls)
    graph = schedule.graph_config(spec, kv_format=kv_format, q_format=q_format, num_heads=heads,
                                  q_tile=schedule.query_tile(q_len, 1), causal=causal, page_size=page)
    if flash and graph is not None:  # the graph form (CUDA-graph capture, metadata made from lengths)
        picked |= {graph.name, *(c.name for c in schedule.graph_combine_configs(spec, num_heads=heads)),
                   SplitScheduleConfig().name}
    return picked


@pytest.mark.parametrize("spec", [H200, GFX942], ids=lambda s: s.name)
@pytest.mark.parametrize("api", ["mla_decode", "flash_mla"])
def test_exactly_the_variants_the_op_selects(spec, api):
    """For every class (mode, heads, page size, query length, causal): the list is exactly what the op's selection
    picks over a grid of problem sizes, nothing missing and nothing it never uses."""
    pages = (1, 64) if api == "flash_mla" else (0, 1, 64)
    for mode, heads, page, q_len, causal in itertools.product(MODES, (16, 64, 128), pages, (1, 2, 4), (False, True)):
        got = set(names(prebuild.call_variants(spec, modes=[mode], page_sizes=[page], heads=[heads], q_lens=[q_len],
                                               causal=[causal], api=api)))
        want = selected(spec, mode, heads, page, q_len, causal, flash=api == "flash_mla")
        assert got == want, (mode, heads, page, q_len, causal, sorted(got ^ want))


def test_both_apis_is_the_union():
    kw = dict(modes=["bf16", "mxfp4"], page_sizes=[0, 64], heads=[16], q_lens=[1, 2], causal=[False, True])
    both = set(names(prebuild.call_variants(H200, api="both", **kw)))
    assert both == (set(names(prebuild.call_variants(H200, api="mla_decode", **kw)))
                    | set(names(prebuild.call_variants(H200, api="flash_mla", **kw))))


def test_flash_mla_drops_causal_for_one_query_token():
    """FlashMLA's rule (mla.flash_mla passes causal only for s_q > 1): no causal kernel for q_len 1, and the
    FlashMLA-shaped kernels are causal for q_len 2."""
    one = names(prebuild.call_variants(H200, modes=["bf16"], page_sizes=[64], heads=[16], causal=[True],
                                       api="flash_mla"))
    assert one and not any("_causal" in n for n in one)
    two = names(prebuild.call_variants(H200, modes=["bf16"], page_sizes=[64], heads=[16], q_lens=[2], causal=[True],
                                       api="flash_mla"))
    assert any(n.endswith("_causal_page64_fused_flash_fn") for n in two)
    # mla_decode compiles the causal variant even for one query token (it is its own kernel there).
    decode = names(prebuild.call_variants(H200, modes=["bf16"], page_sizes=[64], heads=[16], causal=[True],
                                          api="mla_decode"))
    assert all("_causal" in n for n in decode if n.startswith("mla_decode"))


def test_q_len_maps_to_query_tiles_and_a8w8_q_formats():
    got = names(prebuild.call_variants(H200, modes=["bf16"], page_sizes=[0], heads=[32], q_lens=[1, 2, 3, 4, 7]))
    assert {n.split("_qt")[1].split("_")[0] for n in got if n.startswith("mla_decode")} == {"1", "2", "4"}
    codes = names(prebuild.call_variants(H200, modes=["a8w8"], page_sizes=[0], heads=[16], a8w8_q="fp8"))
    assert all("_qfp8_codes_" in n for n in codes if n.startswith("mla_decode"))
    both = names(prebuild.call_variants(H200, modes=["a8w8"], page_sizes=[0], heads=[16], a8w8_q="both"))
    assert {n for n in both if "_qfp8_codes_" in n} and {n for n in both if "_qfp8_h" in n}


def test_warp_specialised_kernel_only_where_the_op_picks_it():
    mxfp4 = names(prebuild.call_variants(H200, modes=["mxfp4"], page_sizes=[0], heads=[16]))
    assert any(n.startswith("mla_decode_ws") for n in mxfp4)
    for args in (dict(modes=["bf16"], heads=[16]), dict(modes=["mxfp4"], heads=[32]),
                 dict(modes=["mxfp4"], heads=[16], q_lens=[2])):
        assert not any(n.startswith("mla_decode_ws") for n in
                       names(prebuild.call_variants(H200, page_sizes=[0], **{"q_lens": [1], **args})))


def test_gfx942_has_no_cuda_only_forms():
    got = prebuild.call_variants(GFX942, modes=MODES, page_sizes=[0, 64], heads=[16, 128], q_lens=[1, 4])
    assert got and not any(getattr(c, "fused_combine", False) or getattr(c, "flash_io", False) for c in got)
    assert not any(n.startswith("mla_decode_ws") for n in names(got))


# --- the command line -------------------------------------------------------------------------------------------


def test_list_prints_names_only(capsys):
    lines = listed(capsys, "--modes", "fp8", "--page-size", "64", "--heads", "16,128")
    assert lines == names(prebuild.call_variants(H200, modes=["fp8"], page_sizes=[64], heads=[16, 128]))
    assert len(lines) == 17  # per head count: split, direct, combine, fused, its flash form; graph form (the
    # split kernel and the combine's two flash forms; the schedule once)


def test_list_defaults_and_only(capsys):
    assert listed(capsys) == names(prebuild.call_variants(H200, modes=MODES, page_sizes=[0], heads=[16]))
    assert listed(capsys, "--only", "mla_combine*") == ["mla_combine_h16_t128"]
    assert listed(capsys, "--target", "gfx942", "--modes", "a8w8", "--page-size", "16") == names(
        prebuild.call_variants(GFX942, modes=["a8w8"], page_sizes=[16], heads=[16]))


def test_list_compiles_nothing(capsys, monkeypatch):
    monkeypatch.setattr(prebuild, "build", lambda *a, **k: pytest.fail("--list built something"))
    assert listed(capsys, "--modes", "mxfp4", "--page-size", "0,16", "--heads", "16,64", "--q-len", "1,2",
                  "--causal", "both")


BAD_ARGS = [
    (["--modes", "fp9"], "--modes", "unknown mode 'fp9'"),
    (["--modes", "bf16,int4"], "--modes", "unknown mode 'int4'"),
    (["--page-size", "8"], "--page-size", "8 is not one of 0, 1, 16, 32, 64, 128"),
    (["--page-size", "64,x"], "--page-size", "expected comma-separated integers"),
    (["--heads", "17"], "--heads", "17 is not one of 16, 32, 64, 128"),
    (["--heads", ""], "--heads", "expected comma-separated integers"),
    (["--q-len", "0"], "--q-len", "0 is less than 1"),
    (["--causal", "yes"], "--causal", "invalid choice"),
    (["--api", "flashinfer"], "--api", "invalid choice"),
    (["--a8w8-q", "fp4"], "--a8w8-q", "invalid choice"),
    (["--target", "sm_80"], "--target", "invalid choice"),
    (["--jobs", "0"], "--jobs", "expected a positive integer"),
    (["--jobs", "many"], "--jobs", "expected a positive integer"),
    (["--api", "flash_mla", "--page-size", "0,64"], "--page-size", "not served by mla.flash_mla"),
    (["--only", "no_such_kernel*"], "--only", "no variant name matches"),
]


@pytest.mark.parametrize("argv,option,message", BAD_ARGS, ids=[" ".join(a) for a, _, _ in BAD_ARGS])
def test_bad_arguments_exit_2_naming_the_option(capsys, argv, option, message):
    with pytest.raises(SystemExit) as exc:
        prebuild.main([*argv, "--list"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err, err


def test_cache_dir_that_is_a_file(scratch, capsys):
    not_a_dir = scratch / "file"
    not_a_dir.write_text("")
    with pytest.raises(SystemExit) as exc:
        prebuild.main(["--cache-dir", str(not_a_dir)])
    assert exc.value.code == 2
    assert "--cache-dir" in capsys.readouterr().err


def test_module_entry_point_exit_status():
    """``python -m mla.prebuild`` itself: 0 for --list, 2 with argparse's usage for a bad value."""
    run = lambda *argv: subprocess.run([sys.executable, "-m", "mla.prebuild", *argv], cwd=ROOT, capture_output=True,
                                       text=True)
    ok = run("--modes", "bf16", "--list")
    assert ok.returncode == 0 and ok.stdout.split() == names(
        prebuild.call_variants(H200, modes=["bf16"], page_sizes=[0], heads=[16])), ok.stderr
    bad = run("--heads", "17")
    assert bad.returncode == 2 and "argument --heads: 17 is not one of" in bad.stderr


def test_no_nvcc_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(prebuild, "find_device_compiler", lambda spec: None)
    monkeypatch.setattr(prebuild, "build", lambda *a, **k: pytest.fail("built without a compiler"))
    assert prebuild.main(["--modes", "bf16", "--only", "mla_combine*"]) == 1
    assert "nvcc" in capsys.readouterr().err


def test_gfx942_without_rocm_lowers_only(monkeypatch, capsys):
    """No hipcc: the variants are lowered (a worker process each), nothing compiled, and the user is told."""
    monkeypatch.setattr(prebuild, "find_device_compiler", lambda spec: None)
    assert prebuild.main(["--target", "gfx942", "--modes", "bf16", "--only", "mla_combine*", "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert "no ROCm" in err and "nothing is cached" in err
    assert "mla_combine_h16_t128: lowered" in out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile CUDA here")
def test_compile_one_variant_into_a_cache_a_fresh_process_loads(scratch):
    """End to end: the combine kernel built by the command into --cache-dir; then a fresh process with no CUDA
    toolkit at all (nvcc off PATH, CUDA_HOME nowhere) gets it from that cache, as a GPU host would."""
    cache = scratch / "tl-cache"
    build = subprocess.run([sys.executable, "-m", "mla.prebuild", "--modes", "bf16", "--heads", "16", "--only",
                            "mla_combine*", "--jobs", "1", "--cache-dir", str(cache)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "[1/1] mla_combine_h16_t128: ready in" in build.stdout
    assert f"into {cache}" in build.stdout
    assert any(cache.rglob("kernel.cubin")), "no compiled kernel in the cache directory"

    no_toolkit = dict(os.environ, TILELANG_CACHE_DIR=str(cache), CUDA_HOME=str(scratch / "no-cuda"),
                      PATH=os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                                           if d and not os.path.exists(os.path.join(d, "nvcc"))))
    no_toolkit.pop("CUDA_PATH", None)
    load = ("from mla import jit, schedule; from mla.target import spec_for_name; s = spec_for_name('sm_90a'); "
            "k = jit.get_kernel(schedule.combine_config(s, num_heads=16), s); "
            "print(k.get_kernel_source().count('__global__'))")
    loaded = subprocess.run([sys.executable, "-c", load], cwd=ROOT, env=no_toolkit, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0 and int(loaded.stdout.split()[-1]) > 0, loaded.stdout + loaded.stderr[-2000:]
    # Control: the same process with an empty cache must fail (it would compile, and has no nvcc), else the load
    # above proves nothing.
    no_toolkit["TILELANG_CACHE_DIR"] = str(scratch / "empty-cache")
    cold = subprocess.run([sys.executable, "-c", load], cwd=ROOT, env=no_toolkit, capture_output=True, text=True,
                          timeout=300)
    assert cold.returncode != 0 and "nvcc" in cold.stderr, cold.stdout + cold.stderr[-2000:]
