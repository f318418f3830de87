"""Trial scripts: the long, repeated fault runs (``python tests/trials/preempt_trials.py --trials 10``,
``python tests/trials/exit_trials.py --runs 50``) whose short CI cuts are tests (``test_preemption.py``,
``test_clean_exit.py``), which import their functions from here."""
