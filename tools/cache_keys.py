"""Which kernels a GPU run needs from the TileLang disk cache, and a carry of just those.

The device machine is reached with at most 64 MiB of carried files, and its host compiles slowly one variant at a
time, so a run carries kernels compiled on the CPU box (``TILELANG_CACHE_DIR``). The whole cache soon outgrows the
carry; this tool names the cache entries one run needs: the bench's variants (flat caches, 16 heads, every mode:
``python -m mla.prebuild --page-size 0 --heads 16 --api mla_decode``) and, optionally, every kernel the given GPU test
modules launch (``tests/helpers.launches``, and a module's ``carry_configs``). Without ``--build`` nothing is
lowered or compiled: TileLang's cache key of each variant is computed (it hashes the TIR, so a refactor that leaves
the generated CUDA unchanged still changes the key).

    MLA_TARGET=sm_90a TILELANG_CACHE_DIR=/work/tlcache python tools/cache_keys.py tests/test_decode_gpu.py
    ... python tools/cache_keys.py --no-bench tests/test_ws_gpu.py --pack .device/tl-cache.tar.xz
    ... python tools/cache_keys.py --no-bench --build 2 tests/test_ws_gpu.py --pack ...  # compile what is missing first

Prints one line per variant: its key and name, ``MISSING`` where the cache lacks it; ``--pack FILE`` writes an xz
tar of the present entries (paths relative to the cache root, as the device scripts unpack them). Exit status 1 if
any is missing.
"""

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def test_configs(spec, modules):
    """The kernel configs the collected tests of ``modules`` launch."""
    import pytest

    class Collect:
        items = []

        def pytest_collection_finish(self, session):
            self.items = list(session.items)

    collect = Collect()
    pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", *modules], plugins=[collect])
    from helpers import classes_of_items, kernel_configs

    configs = kernel_configs(spec, classes_of_items(collect.items))
    # what a module launches beyond its items' declared classes (tests/test_ws_gpu.py: the watchdog children's rings)
    for module in dict.fromkeys(getattr(item, "module", None) for item in collect.items):
        if hasattr(module, "carry_configs"):
            configs += module.carry_configs(spec)
    return configs


def cache_key(cfg, spec) -> str:
    """TileLang's disk-cache key of ``cfg`` on ``spec``, computed the way ``tilelang.compile`` computes it, without
    lowering."""
    import tilelang
    from tilelang.cache import kernel_cache

    from mla import jit

    class Key(Exception):
        pass

    generate = kernel_cache.KernelCache._generate_key

    def stop(self, *args, **kwargs):
        raise Key(generate(self, *args, **kwargs))

    kernel_cache.KernelCache._generate_key = stop
    try:
        tilelang.compile(jit.prim_func(cfg), target=spec.target_dict)
    except Key as key:
        return key.args[0]
    finally:
        kernel_cache.KernelCache._generate_key = generate
    raise RuntimeError(f"{cfg.name}: tilelang.compile returned without computing a cache key")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="GPU test modules whose kernels to add (tests/test_*_gpu.py)")
    parser.add_argument("--no-bench", action="store_true", help="leave out the bench's variants")
    parser.add_argument("--pack", metavar="FILE", help="write an xz tar of the present entries to FILE")
    parser.add_argument("--build", type=int, metavar="JOBS", default=0,
                        help="first compile the variants into the cache with JOBS worker processes (cached ones load)")
    args = parser.parse_args(argv)
    cache = os.environ.get("TILELANG_CACHE_DIR")
    if not cache:
        parser.error("TILELANG_CACHE_DIR: set it to the cache to read (the CPU box's build cache)")
    from mla import prebuild
    from mla.target import spec_for_name

    spec = spec_for_name(os.environ.get("MLA_TARGET", "sm_90a"))
    configs = [] if args.no_bench else prebuild.call_variants(spec, modes=tuple(prebuild.MODES), page_sizes=(0,),
                                                              heads=(16,), api="mla_decode")
    if args.modules:
        configs += test_configs(spec, args.modules)
    if args.build:
        prebuild.build(configs, spec, jobs=args.build, progress=True, label="cache_keys --build")
    import tilelang

    kernels = os.path.join(tilelang.__version__, "linux-x86_64", "kernels")
    present, missing = [], 0
    for cfg in prebuild.unique(configs):
        key = cache_key(cfg, spec)
        if os.path.isdir(os.path.join(cache, kernels, key)):
            present.append(os.path.join(".", kernels, key))
            print(key, cfg.name)
        else:
            missing += 1
            print("MISSING", cfg.name)
    print(f"{len(present)} present, {missing} missing in {cache}", file=sys.stderr)
    if args.pack:
        listing = "\n".join(present) + "\n"
        tar = subprocess.run(["tar", "-cf", "-", "-T", "-"], cwd=cache, input=listing.encode(), capture_output=True,
                             check=True)
        with open(args.pack, "wb") as out:
            subprocess.run(["xz", "-6", "-T2"], input=tar.stdout, stdout=out, check=True)
        print(f"packed {len(present)} kernels into {args.pack} ({os.path.getsize(args.pack) / 2**20:.1f} MiB)",
              file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
