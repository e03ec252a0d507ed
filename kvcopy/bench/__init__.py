"""kvcopy.bench: the ``kvcopy-bench`` command line, a tool around the library.

Nothing in the library imports it. Modules, one per subcommand plus what they share:

* :mod:`.cli` dispatches ``kvcopy-bench SUBCOMMAND`` (imports a subcommand's module
  only when it is chosen);
* :mod:`.run` ``run`` (the default), ``sweep`` and ``list``; :mod:`.nixl` ``nixl``;
  :mod:`.calibrate` ``calibrate``; ``fuzz`` is :mod:`kvcopy.testing.nixl.fuzz`;
* :mod:`.args` the scenario and measurement flags; :mod:`.scenarios` the presets and
  the caches they build; :mod:`.timing` the round-robin timer, op counts, environment
  facts; :mod:`.output` the table, summary, JSON/CSV, plot and progress bar.
"""
