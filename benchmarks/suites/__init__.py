"""Benchmark suites: each module here exposes ``run(quick: bool, out_dir: Path, **options) -> dict``.

``python benchmarks/run.py <suite|all>`` discovers every module of this package that has a
``run`` function (modules whose names start with ``_`` are skipped) and runs it; options a suite's
``run`` does not accept (``--sizes``, ``--ranks``, ...) are not passed to it.
"""
