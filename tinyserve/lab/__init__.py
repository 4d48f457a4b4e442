"""Models and measurements that the book's views are drawn from, kept free of matplotlib.

Each module here drives the real package objects (the BlockSpaceManager, the simulator, the
reference attention) and returns plain data; ``tinyserve.viz`` only draws that data. Benchmarks,
exercises and tests can use these modules without importing a drawing library.

By chapter: ``kv_memory`` (01: cache sizes, the fragmentation simulator), ``block_snapshot`` and
``block_stories`` (02, 03), ``block_ops`` (03's widget script), ``records`` and ``batching``
(04, 05: reading rounds, static batching, the preemption sweep), ``whatif`` (05),
``marked_cache`` and ``cache_sizing`` (06), ``paged_run`` (07), ``kernel_plan``,
``softmax_walk``, ``kernel_walk`` and ``bandwidth`` (08), ``tracing`` (09), ``tp_memory`` (10),
``perf`` (11 and ``benchmarks/``), ``beyond_runs`` (12), ``policy_runs`` (13).
"""
