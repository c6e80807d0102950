"""The benchmark library behind ``bench.py`` (the command line) and ``tools/`` (the developer scripts).

Layers: ``bench.py`` and ``tools/`` import this package; it imports ``mla`` (the op), never ``bench`` or ``tools``;
``mla`` imports ``tl_kernels``. One module per concern, each importable alone:

    timing     GPU timing: CUDA events around one call with a cold L2, the read ceiling, the host-cost timers
    cases      what is timed: cases and their tables, the shape / mode / grid parsers, bytes and flops per call,
               the kernels and split count the op selects for a case
    calls      the callables timed: inputs, our op (eager, planned, FlashMLA-shaped), fp32 references and checks
    baselines  the harness template's two naive torch versions
    peers      FlashInfer, FlashMLA and AMD aiter: detection, untimed setup, the call to time
    measure    one run's rows: a measurement per (case, implementation), with its check
    host       the host-cost table: wall time per call against the call's GPU time
    report     the printed lines and tables
    jsonio     the JSON file (rows and a header of where and how they were measured)
    plots      the PNG bar chart of achieved GB/s
    run        a whole run: on a GPU, every table; without one, the kernels the run would use, compiled
"""
