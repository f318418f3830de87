"""What the tests share: starting and reaping processes, the zygote jobs fork from, network-namespace hosts,
an S3 server, multi-node command lines, a single-process reference run and the paths a job imports from.

One package, imported as ``support.<module>`` (``tests/`` is on the path: pytest's ``pythonpath`` for the
tests, :func:`support.paths.job_pythonpath` for the jobs they start), so that a newcomer finds every helper in
one folder and a test file in ``tests/`` is always a test. See docs/testing.md, "Where a test goes".
"""
