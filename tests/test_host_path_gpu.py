"""The op's host path on the GPU: no host-device synchronisation in a call (torch's sync debug mode raises on one),
and the buffers the op keeps across calls (``mla.workspace``) living where neither torch.compile's CUDA-graph trees
nor a CUDA-graph capture object to them."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla.decode
from mla import workspace
from mla.inputs import make_harness_inputs, to_paged

from conftest import requires_gpu
from helpers import MODES, check_against_reference, launches, reference_for, run_mode

pytestmark = requires_gpu

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class sync_forbidden:
    """``torch.cuda.set_sync_debug_mode("error")`` inside: any synchronising torch call raises."""

    def __enter__(self):
        self.previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.previous)


@launches(lambda mode, page_size, **_: [(mode, 16, 1, False, page_size)])
@pytest.mark.parametrize("num_splits", [None, 1], ids=["default_splits", "one_split"])
@pytest.mark.parametrize("entry", ["eager", "plan"])
@pytest.mark.parametrize("page_size", [0, 16], ids=["flat", "paged16"])
@pytest.mark.parametrize("mode", MODES)
def test_no_host_device_sync_in_a_call(mode, page_size, entry, num_splits):
    """4 x 1024 (16 KV splits by default: decode + combine); the first call (kernel load, constants) runs outside
    the check, every later one inside it."""
    data = make_harness_inputs(4, 1024, seed=3)
    run_data, table = data, None
    if page_size:
        paged, table = to_paged(data, page_size, seed=1)
        run_data = (data[0], paged, *data[2:])
    if entry == "eager":
        def call():
            return run_mode(mla.decode.mla_decode, mode, run_data, page_table=table, num_splits=num_splits)
    else:  # planned once, outside the check (a plan reads its offsets on the host)
        q, kv_data, _, _, _ = run_data
        kv, kwargs = mla.decode.harness_cache(kv_data, mode)
        kv_format, q_format = kwargs.pop("kv_format"), kwargs.pop("q_format")
        paging = dict(page_size=mla.decode.page_size_of(kv), page_table=table) if table is not None else {}
        the_plan = mla.decode.plan([0, 1, 2, 3, 4], [0, 1024, 2048, 3072, 4096], num_heads=16, kv_format=kv_format,
                                   q_format=q_format, num_splits=num_splits, device="cuda", **paging)

        def call():
            return the_plan.run(q, kv, **kwargs)
    call()
    torch.cuda.synchronize()
    with sync_forbidden():
        for _ in range(3):
            out = call()
    check_against_reference(out, reference_for(mode, data)[0], mode, data[2], data[3],
                            context=f"{entry}, page_size {page_size}, num_splits {num_splits}")


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (nothing of the op exists yet there), from the repository root."""
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=600)


@launches(lambda **_: [("bf16", 16, 1, False), ("a8w8", 16, 1, False)])
def test_first_call_inside_reduce_overhead_compile():
    """The op's first call in a process happens inside torch.compile(mode="reduce-overhead"): its constants are
    made during the CUDA-graph trees' warm-up, outside their pool, so recording and replay go through."""
    result = run_python("""
        import torch
        from torch._dynamo.utils import counters
        import mla.ops
        from mla.inputs import make_harness_inputs
        from mla.decode import run_harness
        data = make_harness_inputs(4, 1024, seed=0)
        for mode in ("bf16", "a8w8"):
            torch._dynamo.reset()
            counters.clear()
            fn = torch.compile(lambda q: run_harness((q, *data[1:]), mode, op=mla.ops.mla_decode) * 2,
                               fullgraph=True, mode="reduce-overhead")
            results = [fn(data[0]).clone() for _ in range(4)]  # warm-up, record, replays
            assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
            eager = run_harness(data, mode) * 2
            for r in results:
                torch.testing.assert_close(r, eager, rtol=0, atol=0)
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_semaphores_outside_graph_pools():
    """workspace.semaphores first made inside a reduce-overhead compiled function (a custom op standing in for a
    fused kernel), then used eagerly and inside a CUDA-graph capture on another stream."""
    result = run_python("""
        import torch
        from torch._dynamo.utils import counters
        from mla import workspace

        @torch.library.custom_op("mla_test::count", mutates_args=())
        def count(x: torch.Tensor) -> torch.Tensor:
            sem = workspace.semaphores(x.device, 1000)
            sem[:x.numel()] += 1  # used, then left at zero again (as the fused kernels do)
            y = x + sem[:x.numel()].float()
            sem[:x.numel()] -= 1
            return y

        @count.register_fake
        def _(x):
            return torch.empty_like(x)

        fn = torch.compile(lambda x: count(x) * 2, fullgraph=True, mode="reduce-overhead")
        x = torch.randn(64, device="cuda")
        for _ in range(4):
            y = fn(x).clone()
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        torch.testing.assert_close(y, (x + 1) * 2)
        first = workspace.semaphores(x.device, 1000)
        assert workspace.semaphores(x.device, 10) is first, "one buffer per (device, stream)"
        torch.testing.assert_close(count(x), x + 1)

        graph = torch.cuda.CUDAGraph()  # captures on its own stream: a fresh, graph-owned buffer
        with torch.cuda.graph(graph):
            static = count(x)
        static.zero_()
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, x + 1)
        assert not first.any()
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_constants_are_made_before_capture():
    """A first call inside CUDA-graph capture cannot make the op's constants: a clear error, not garbage."""
    result = run_python("""
        import torch
        from mla import workspace
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                workspace.unit_scale(torch.device("cuda", torch.cuda.current_device()))
        except RuntimeError as exc:  # ours, or capture_end's with ours as its context
            messages = [str(exc), str(exc.__context__)]
            assert any("before capturing" in m for m in messages), messages
            print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_unit_scale_is_one():
    device = torch.device("cuda", torch.cuda.current_device())
    assert workspace.unit_scale(device).tolist() == [1.0]
    assert not workspace.no_block_scales(device).any()


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("mode", ["bf16", "a8w8"])
def test_eager_scratch_is_per_stream_and_never_captured(mode):
    """The eager call's scratch (split partials, the LSE nobody reads, a8w8's amax(|q|)) is one buffer per stream:
    two streams running eager calls at once do not race; a CUDA-graph capture takes its own (graph-owned) scratch,
    so eager calls on the capturing stream between replays leave the graph's result alone."""
    data = make_harness_inputs(4, 1024, seed=0)
    other = make_harness_inputs(4, 1024, seed=1)  # same signature, other values
    expected, expected_other = run_mode(mla.decode.mla_decode, mode, data), run_mode(mla.decode.mla_decode, mode, other)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(20):  # interleaved, no synchronisation between the streams
        for s, inputs, got in zip(streams, (data, other), outs):
            with torch.cuda.stream(s):
                got.append(run_mode(mla.decode.mla_decode, mode, inputs))
    torch.cuda.synchronize()
    for got, want in zip(outs, (expected, expected_other)):
        for out in got:
            torch.testing.assert_close(out, want, rtol=0, atol=0)

    device = data[0].device
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run_mode(mla.decode.mla_decode, mode, data)
    with torch.cuda.stream(torch.cuda.graph.default_capture_stream):  # eager calls on the stream that captured
        run_mode(mla.decode.mla_decode, mode, other)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, expected, rtol=0, atol=0)
    assert workspace.scratch(device, 1) is not None, "outside capture: the stream's scratch"
