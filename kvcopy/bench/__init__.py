"""kvcopy.bench: the ``kvcopy-bench`` command line, a tool around the library.

Nothing in the library imports it. Modules, one per subcommand plus what they share:

* :mod:`.cli` dispatches ``kvcopy-bench SUBCOMMAND`` (imports a subcommand's module
  only when it is chosen; ``--help`` needs no torch);
* :mod:`.run` ``run`` (the default), ``sweep`` and ``list``; :mod:`.nixl` ``nixl``
  (its rows, and the request the two-host variant shares);
  :mod:`.calibrate` ``calibrate``; :mod:`.overhead` ``overhead``; :mod:`.fuzzing`
  ``fuzz`` (:mod:`kvcopy.testing.nixl.fuzz` with a progress bar);
* :mod:`.args` the scenario and measurement flags; :mod:`.presets` the presets and
  names as plain data; :mod:`.scenarios` the scenarios and the caches they build;
  :mod:`.timing` the round-robin timer, statistics, op counts, environment facts;
  :mod:`.output` the table, noise flags, summary, JSON/CSV and progress bar;
  :mod:`.plot` the ``--plot`` figure; :mod:`.units` byte sizes and counts in text.
"""
