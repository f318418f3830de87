"""ft_hsdp's timeouts: the rule's values, the defaults it gives, and a clear error for each inconsistent set.

No process starts here: every check runs at construction, before any process group.
"""

from __future__ import annotations

import pytest

from fsdp_strategies.ft import FTHSDPStrategy
from fsdp_strategies.ft.launch.options import LaunchOptionError, LaunchOptions
from fsdp_strategies.ft.timeouts import (
    LIGHTHOUSE_TIMEOUTS_ENV,
    TORCHFT_LIGHTHOUSE_DEFAULTS,
    LighthouseTimeouts,
    Timeouts,
    check_lighthouse_timeouts,
    check_timeouts,
    derive_timeouts,
    heal_timeout_s,
    lighthouse_wait_s,
    quorum_p99_s,
)

ADDR = "http://localhost:1"
LAUNCHER = LighthouseTimeouts(2000, 1000, 100)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", LIGHTHOUSE_TIMEOUTS_ENV,
                "TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC"):
        monkeypatch.delenv(var, raising=False)


def strategy(groups: int = 2, **kwargs: object) -> FTHSDPStrategy:
    return FTHSDPStrategy(lighthouse_addr=ADDR, replica_group_id=0, num_replica_groups=groups, **kwargs)


# ------------------------------------------------------------------------------------------------ the rule
def test_the_rule_by_hand_for_a_few_group_counts() -> None:
    assert lighthouse_wait_s(LAUNCHER) == pytest.approx(3.1)
    assert lighthouse_wait_s(TORCHFT_LIGHTHOUSE_DEFAULTS) == pytest.approx(65.1)
    assert quorum_p99_s(2) == pytest.approx(0.108)
    assert quorum_p99_s(1024) == pytest.approx(4.196)
    # the launcher's lighthouse, every step of 10 s: 2 x (3.1 + 0.108 + 10) = 26.4 s < the 60 s floor
    assert derive_timeouts(2, lighthouse=LAUNCHER) == Timeouts(60.0, 60.0, 10.0)
    # 4,096 groups: 2 x (3.1 + 16.484 + 10) = 59.168 -> still the floor; 8,192: 2 x (3.1 + 32.868 + 10) =
    # 91.936
    assert derive_timeouts(4096, lighthouse=LAUNCHER).quorum_timeout_s == 60.0
    assert derive_timeouts(8192, lighthouse=LAUNCHER).quorum_timeout_s == pytest.approx(91.936)
    # rounds of 8 steps of 10 s at 1,024 groups: 2 x (3.1 + 4.196 + 80) = 174.592
    assert derive_timeouts(1024, sync_every=8, lighthouse=LAUNCHER).quorum_timeout_s == pytest.approx(174.592)
    # an unknown lighthouse is assumed to be torchft_lighthouse's defaults: 2 x (65.1 + 0.108 + 10) = 150.416
    assert derive_timeouts(2).quorum_timeout_s == pytest.approx(150.416)
    # a 40 GB state per rank at 1 Gbit/s: 2 x 40e9 / 125e6 + 10 = 650 s collective/heal timeout, and the
    # quorum
    # timeout follows it (it is longer than the lighthouse's wait)
    assert heal_timeout_s(40e9) == pytest.approx(650.0)
    derived = derive_timeouts(2, state_bytes=40e9, lighthouse=LAUNCHER)
    assert (derived.timeout_s, derived.quorum_timeout_s) == (pytest.approx(650.0), pytest.approx(650.0))
    # a small state keeps torchft's 60 s floor
    assert derive_timeouts(2, state_bytes=1e6, lighthouse=LAUNCHER).timeout_s == 60.0


@pytest.mark.parametrize("groups", [1, 2, 64, 1024, 100_000])
@pytest.mark.parametrize("sync_every", [1, 8, 500])
@pytest.mark.parametrize("lighthouse", [None, LAUNCHER, LighthouseTimeouts(300, 30000, 50)])
def test_derived_defaults_pass_their_own_checks(
    groups: int, sync_every: int, lighthouse: LighthouseTimeouts
) -> None:
    derived = derive_timeouts(groups, sync_every=sync_every, lighthouse=lighthouse)
    check_timeouts(derived, lighthouse or TORCHFT_LIGHTHOUSE_DEFAULTS, env={})
    assert derived.connect_timeout_s <= derived.quorum_timeout_s
    assert derived.timeout_s <= derived.quorum_timeout_s


# ------------------------------------------------------------------------------------------------ the
# strategy
def test_strategy_defaults_come_from_the_rule_and_the_launchers_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = strategy()
    assert (s.timeout_s, s.quorum_timeout_s, s.connect_timeout_s) == (60.0, pytest.approx(150.416), 10.0)
    monkeypatch.setenv(LIGHTHOUSE_TIMEOUTS_ENV, "2000,1000,100")  # what the launcher passes with its defaults
    s = strategy()
    assert (s.timeout_s, s.quorum_timeout_s, s.connect_timeout_s) == (60.0, 60.0, 10.0)
    s = strategy(groups=4, sync="diloco", sync_every=8)  # 2 x (3.1 + 0.116 + 80)
    assert s.quorum_timeout_s == pytest.approx(166.432)
    # an explicit collective/heal timeout lifts the derived quorum timeout with it
    s = strategy(timeout_s=300)
    assert (s.timeout_s, s.quorum_timeout_s, s.connect_timeout_s) == (300, 300, 10.0)


def test_an_explicit_consistent_set_is_kept_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIGHTHOUSE_TIMEOUTS_ENV, "2000,30000,100")
    s = strategy(timeout_s=30, quorum_timeout_s=60, connect_timeout_s=10)  # configs/ft_hsdp*.yaml's values
    assert (s.timeout_s, s.quorum_timeout_s, s.connect_timeout_s) == (30, 60, 10)
    # the tests' workers leave the quorum timeout out: derived, 2 x (2 + 30 + 0.1 + 0.108 + 10)
    s = strategy(timeout_s=10, connect_timeout_s=5)
    assert (s.timeout_s, s.quorum_timeout_s, s.connect_timeout_s) == (10, pytest.approx(84.416), 5)


# ------------------------------------------------------------------------------------------------ clear
# errors
@pytest.mark.parametrize(("kwargs", "env", "message"), [
    ({"connect_timeout_s": 90, "quorum_timeout_s": 60},
     {},
     r"connect_timeout_s=90 is longer than quorum_timeout_s=60.*Fix: connect_timeout_s <= quorum_timeout_s"),
    ({"timeout_s": 120, "quorum_timeout_s": 60},
     {},
     r"quorum_timeout_s=60 is shorter than timeout_s=120, "
     r"the collective/heal timeout.*Fix: quorum_timeout_s >= "
         r"timeout_s \(e.g. quorum_timeout_s=120\)"),
    ({"timeout_s": 5, "quorum_timeout_s": 20},
     {LIGHTHOUSE_TIMEOUTS_ENV: "5000,30000,100"},
     r"quorum_timeout_s=20 is shorter than the lighthouse's "
     r"wait.*heartbeat_timeout_ms=5000.*join_timeout_ms=30000"
     r".*quorum_tick_ms=100 = 35.1 s.*Fix: quorum_timeout_s >= 70.2"),
    ({"timeout_s": 30, "quorum_timeout_s": 60},
     {"TORCHFT_QUORUM_TIMEOUT_SEC": "20"},
     r"TORCHFT_QUORUM_TIMEOUT_SEC=20 \(overrides quorum_timeout_s=60\) is shorter than timeout_s=30"),
    ({"quorum_timeout_s": 60},
     {"TORCHFT_CONNECT_TIMEOUT_SEC": "61"},
     r"TORCHFT_CONNECT_TIMEOUT_SEC=61 \(overrides connect_timeout_s=10\) is longer than quorum_timeout_s=60"),
    ({"timeout_s": -1}, {}, r"timeout_s=-1 is invalid. Fix: a positive number of seconds, or leave it unset"),
    ({}, {"TORCHFT_TIMEOUT_SEC": "1.5"}, r"TORCHFT_TIMEOUT_SEC='1.5' is not a whole number of seconds"),
    ({}, {LIGHTHOUSE_TIMEOUTS_ENV: "2000,1000"},
     r"FSDP_STRATEGIES_FT_LIGHTHOUSE_TIMEOUTS_MS='2000,1000' is not"),
])
def test_an_inconsistent_set_is_refused_naming_options_values_and_fix(
        monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, float], env: dict[str, str], message: str) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        strategy(**kwargs)


def test_without_the_launchers_variable_the_lighthouse_checks_are_skipped() -> None:
    # a lighthouse started elsewhere: its timeouts are not visible here, so only what the strategy sees is
    # checked
    s = strategy(timeout_s=5, quorum_timeout_s=20)
    assert s.quorum_timeout_s == 20


# ------------------------------------------------------------------------------------------------ the
# launcher
@pytest.mark.parametrize(("flags", "message"), [
    ({"heartbeat_timeout_ms": 150}, r"--heartbeat-timeout-ms 150: the groups heartbeat every 100 ms.*Fix: "
                                    r"--heartbeat-timeout-ms >= 200"),
    ({"heartbeat_timeout_ms": 500, "quorum_tick_ms": 1000},
     r"--quorum-tick-ms 1000 with --heartbeat-timeout-ms 500.*"
                                                            r"Fix: --quorum-tick-ms <= 500"),
])
def test_the_launcher_refuses_an_inconsistent_lighthouse(flags: dict[str, int], message: str) -> None:
    with pytest.raises(LaunchOptionError, match=message):
        LaunchOptions(**flags).validate(["train.py"])


def test_the_launchers_defaults_and_variable_round_trip() -> None:
    options = LaunchOptions()
    options.validate(["train.py"])
    assert check_lighthouse_timeouts(options.lighthouse_timeouts()) is None
    env = options.lighthouse_timeouts().to_env()
    assert LighthouseTimeouts.from_env(env) == LAUNCHER
    assert LighthouseTimeouts.from_env({}) is None
