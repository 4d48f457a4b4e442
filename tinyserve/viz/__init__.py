"""Views over the real objects: source rendering, matplotlib drawings, ipywidgets steppers.

This is the bottom layer: it may import every other module of the package, and none of them
imports it. It only draws: what a drawing shows is computed by the package itself or by the
matplotlib-free ``tinyserve.lab``. Nothing is re-exported here; import a name from the module
that defines it (``from tinyserve.viz.source import show``, ``from tinyserve.viz.rounds import
draw_timeline``), so every name has one home.

Modules by chapter: ``source`` (listings, every chapter), ``style`` (pyplot and the colours),
``figures`` (the registry behind ``make figures``), ``architecture`` (00), ``kv_cache`` (01),
``slots`` (02), ``blocks`` (02, 03), ``rounds`` (04, 05, 09), ``cache`` (06), ``attention`` (07),
``attention_kernel`` (08), ``engine`` (09), ``parallel`` (10), ``performance`` (11),
``beyond`` (12), ``policies`` (13); the widgets ``stepper``, ``widgets_blocks``, ``widgets_orca``
(04, 13), ``whatif``,
``kernel_walk`` over ``widget_view``.
"""
