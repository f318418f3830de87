"""``ft_hsdp``'s timeouts: what each one bounds, the rule that derives their defaults, and the checks of a
set.

What each timeout bounds (torchft 0.2.0, read from ``torchft.manager`` and the lighthouse's options)
----------------------------------------------------------------------------------------------------

Set on every rank's ``torchft.Manager`` (options of :class:`~fsdp_strategies.ft.strategy.FTHSDPStrategy`):

* ``timeout_s`` -- every cross-group operation except the quorum: the fault-tolerant all-reduce (it is the
  timeout of the cross-group process group: a collective whose peer vanished without closing its connections
  waits this long before the step is marked errored and discarded), ``should_commit``'s vote, the request for
  a peer's checkpoint metadata, and the **heal transfer** itself (the live state sent and received, either
  transport). It must therefore fit the transfer of this rank's whole state.
* ``quorum_timeout_s`` -- how long a rank's request to the lighthouse waits for a quorum. That wait contains
  the lighthouse dropping a dead group (its heartbeat timeout), waiting for live but slow groups (its join
  timeout), its evaluation tick, and a peer still busy with its step, its round or a heal. torchft's guidance
  is "longer than a step" (for DiLoCo / local SGD: longer than a round).
* ``connect_timeout_s`` -- opening the RPC connection to the lighthouse and to a peer's manager (retried with
  backoff until it expires); the strategy's TCP check of the lighthouse uses it too.
* torchft's own variables ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC`` and
  ``TORCHFT_CONNECT_TIMEOUT_SEC`` (whole seconds) override those three inside the manager, so the checks here
  use the values torchft will use (:func:`effective`).

Set on the lighthouse (``fsdp-strategies-ft`` flags, or ``torchft_lighthouse``'s, whose defaults are 5000 /
60000 / 100 ms):

* ``heartbeat_timeout_ms`` -- a group whose last heartbeat (a manager sends one every 100 ms) is older than
  this is no longer counted: the time to drop a dead group, i.e. the survivors' stall per fault.
* ``join_timeout_ms`` -- once ``min_replicas`` groups have asked, how long the lighthouse waits for the other
  groups that still heartbeat before it forms a quorum without them.
* ``quorum_tick_ms`` -- how often the lighthouse re-evaluates; each wait above ends on a tick.

So one quorum may wait ``heartbeat + join + tick`` for the lighthouse alone (:func:`lighthouse_wait_s`).
torchtitan#2899 writes the hierarchy down by hand for torchtitan's options (the fault-tolerant collective's
timeout below the in-group training timeout, below the initialisation timeout, so that the fault-tolerant
layer discards a step before the in-group watchdog kills the job). Here the in-group process group keeps
``torch.distributed``'s default (10 minutes), above every value the rule derives.

The rule (:func:`derive_timeouts`), for ``N`` replica groups, ``sync_every`` steps per cross-group sync and
an expected step time ``step_s`` (default :data:`ASSUMED_STEP_S`):

* ``timeout_s`` = max(torchft's default 60 s, ``HEAL_MARGIN`` x state bytes / heal bandwidth + ``step_s``);
  without a state size (at construction the model does not exist yet) it is 60 s.
* ``quorum_timeout_s`` = max(``timeout_s``, ``MARGIN`` x (heartbeat + join + tick + quorum p99 at N +
  ``sync_every`` x ``step_s``)): long enough for the lighthouse to drop a dead group and admit a slow one, for
  the quorum round trip at N groups, and for a peer to finish its step (round) -- and never shorter than a
  heal.
* ``connect_timeout_s`` = min(10 s, ``quorum_timeout_s``).

The quorum latency at N (:func:`quorum_p99_s`) is a line fitted to measurements; its constants name their
source. The checks (:func:`check_timeouts`) refuse a set in which a quorum cannot wait out what it must wait
for: ``connect_timeout_s > quorum_timeout_s``, ``quorum_timeout_s < timeout_s`` (a heal or a hung collective
outlasts the quorum that waits for it), and, where the lighthouse's values are known (the launcher passes them
in :data:`LIGHTHOUSE_TIMEOUTS_ENV`), ``quorum_timeout_s < heartbeat + join + tick``. The launcher checks its
own three (:func:`check_lighthouse_timeouts`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ASSUMED_STEP_S", "LIGHTHOUSE_TIMEOUTS_ENV", "LighthouseTimeouts", "Timeouts",
           "check_lighthouse_timeouts",
           "check_timeouts", "derive_timeouts", "effective", "heal_timeout_s", "lighthouse_wait_s",
           "quorum_p99_s"]

#: torchft's ``Manager`` default for ``timeout`` and ``quorum_timeout``: the floor of both
TORCHFT_DEFAULT_S = 60.0
#: the connect timeout's default (torchft's is 60 s; a wrong lighthouse address should fail sooner)
CONNECT_DEFAULT_S = 10.0
#: a torchft manager heartbeats every 100 ms: a heartbeat timeout must span at least two of them
HEARTBEAT_INTERVAL_MS = 100
#: a step of a large model on a GPU cluster (Llama 3 405B on 16K GPUs: 6 x 405e9 params x 16M tokens /
#: (16,384 GPUs x 400 TFLOP/s) ~ 6 s); a longer step needs an explicit ``quorum_timeout_s``
ASSUMED_STEP_S = 10.0
#: headroom of every derived timeout over what it must wait for (a p99 is not a maximum)
MARGIN = 2.0
#: headroom of the heal transfer over state / bandwidth
HEAL_MARGIN = 2.0
#: bandwidth assumed for a heal when none is given: 1 Gbit/s Ethernet, the slowest link a cross-group heal
#: should cross (an assumption, not a measurement: pass the measured one to :func:`heal_timeout_s`)
HEAL_BANDWIDTH_BYTES_PER_S = 125e6
#: quorum round trip seen by a group, p99, as a + b x N: an upper envelope of ``ft_scale``'s measured p99
#: (``benchmarks/results/ft_scale-cpu.json``, ``sweep[].quorum_s.p99``: 4 ms at N = 2, 0.09 s at 128, 1.6 s at
#: 512, 3.6 s at 1,024 simulated groups on a 2-core host whose cores the groups and the lighthouse share)
QUORUM_P99_BASE_S = 0.1
QUORUM_P99_PER_GROUP_S = 0.004
#: what ``fsdp-strategies-ft`` passes to each group: ``heartbeat_timeout_ms,join_timeout_ms,quorum_tick_ms``
LIGHTHOUSE_TIMEOUTS_ENV = "FSDP_STRATEGIES_FT_LIGHTHOUSE_TIMEOUTS_MS"
#: torchft's overrides of the manager's three timeouts (whole seconds)
TORCHFT_ENV = {"timeout_s": "TORCHFT_TIMEOUT_SEC", "quorum_timeout_s": "TORCHFT_QUORUM_TIMEOUT_SEC",
               "connect_timeout_s": "TORCHFT_CONNECT_TIMEOUT_SEC"}


@dataclass(frozen=True)
class LighthouseTimeouts:
    """The lighthouse's three timeouts in milliseconds (``fsdp-strategies-ft``'s defaults)."""

    heartbeat_timeout_ms: int = 2000
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 100

    def to_env(self) -> dict[str, str]:
        """The variable the launcher sets for every group."""
        value = f"{self.heartbeat_timeout_ms},{self.join_timeout_ms},{self.quorum_tick_ms}"
        return {LIGHTHOUSE_TIMEOUTS_ENV: value}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LighthouseTimeouts | None:
        """What the launcher passed, or ``None`` (a lighthouse started elsewhere: its values are not known
        here)."""
        text = (os.environ if env is None else env).get(LIGHTHOUSE_TIMEOUTS_ENV, "")
        if not text:
            return None
        try:
            hb, join, tick = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(
                f"{LIGHTHOUSE_TIMEOUTS_ENV}={text!r} is not 'HEARTBEAT_MS,JOIN_MS,TICK_MS'. Fix: unset it "
                "(fsdp-strategies-ft sets it for its groups) or give three integers."
            ) from None
        return cls(hb, join, tick)


#: ``torchft_lighthouse``'s own defaults: what the rule assumes for a lighthouse started outside the launcher
TORCHFT_LIGHTHOUSE_DEFAULTS = LighthouseTimeouts(5000, 60000, 100)


@dataclass(frozen=True)
class Timeouts:
    """The manager's three timeouts in seconds."""

    timeout_s: float
    quorum_timeout_s: float
    connect_timeout_s: float


def lighthouse_wait_s(lighthouse: LighthouseTimeouts) -> float:
    """The longest a quorum waits on the lighthouse alone: drop a dead group, admit a slow one, one tick."""
    return (lighthouse.heartbeat_timeout_ms + lighthouse.join_timeout_ms + lighthouse.quorum_tick_ms) / 1000


def quorum_p99_s(num_replica_groups: int) -> float:
    """The quorum round trip's p99 at ``num_replica_groups`` groups (see :data:`QUORUM_P99_BASE_S`)."""
    return QUORUM_P99_BASE_S + QUORUM_P99_PER_GROUP_S * num_replica_groups


def heal_timeout_s(state_bytes: float, bandwidth_bytes_per_s: float = HEAL_BANDWIDTH_BYTES_PER_S,
                   step_s: float = ASSUMED_STEP_S) -> float:
    """The collective/heal timeout a state of ``state_bytes`` per rank needs: its transfer with headroom, plus
    a step."""
    return HEAL_MARGIN * state_bytes / bandwidth_bytes_per_s + step_s


def derive_timeouts(num_replica_groups: int, *, sync_every: int = 1, step_s: float = ASSUMED_STEP_S,
                    state_bytes: float | None = None,
                    bandwidth_bytes_per_s: float = HEAL_BANDWIDTH_BYTES_PER_S,
                    lighthouse: LighthouseTimeouts | None = None) -> Timeouts:
    """The rule of the module docstring (``lighthouse=None``: ``torchft_lighthouse``'s defaults, the
    longest)."""
    lighthouse = lighthouse or TORCHFT_LIGHTHOUSE_DEFAULTS
    timeout = TORCHFT_DEFAULT_S
    if state_bytes is not None:
        timeout = max(timeout, heal_timeout_s(state_bytes, bandwidth_bytes_per_s, step_s))
    wait = lighthouse_wait_s(lighthouse) + quorum_p99_s(num_replica_groups) + sync_every * step_s
    quorum = max(timeout, MARGIN * wait)
    return Timeouts(timeout, quorum, min(CONNECT_DEFAULT_S, quorum))


def effective(name: str, value: float, env: Mapping[str, str] | None = None) -> tuple[float, str]:
    """The value torchft will use for the manager option ``name`` and how it was set (option or variable)."""
    var = TORCHFT_ENV[name]
    text = (os.environ if env is None else env).get(var)
    if text is None:
        return value, f"{name}={value:g}"
    try:
        return float(int(text)), f"{var}={text} (overrides {name}={value:g})"
    except ValueError:
        raise ValueError(
            f"{var}={text!r} is not a whole number of seconds (torchft reads it with int()). Fix: "
            f"unset it or give an integer."
        ) from None


def check_timeouts(timeouts: Timeouts, lighthouse: LighthouseTimeouts | None = None,
                   env: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the options, their values and the fix if the set cannot work together.

    ``lighthouse``: the lighthouse's values when known (the launcher's variable), else those checks are
    skipped.
    """
    timeout, t_name = effective("timeout_s", timeouts.timeout_s, env)
    quorum, q_name = effective("quorum_timeout_s", timeouts.quorum_timeout_s, env)
    connect, c_name = effective("connect_timeout_s", timeouts.connect_timeout_s, env)
    if connect > quorum:
        raise ValueError(
            f"ft_hsdp: {c_name} is longer than {q_name}: a quorum request would time out before its "
            f"connection to the lighthouse is given up. Fix: connect_timeout_s <= quorum_timeout_s "
            f"(e.g. connect_timeout_s={min(CONNECT_DEFAULT_S, quorum):g})."
        )
    if quorum < timeout:
        raise ValueError(
            f"ft_hsdp: {q_name} is shorter than {t_name}, the collective/heal timeout: a peer may spend "
            f"up to {timeout:g} s in a heal transfer or a hung all-reduce, and the others' quorum would "
            f"time out waiting for it. Fix: quorum_timeout_s >= timeout_s (e.g. quorum_timeout_s="
            f"{max(timeout, TORCHFT_DEFAULT_S):g}), or leave quorum_timeout_s unset to derive it."
        )
    if lighthouse is not None and quorum < lighthouse_wait_s(lighthouse):
        raise ValueError(
            f"ft_hsdp: {q_name} is shorter than the lighthouse's wait for a quorum: heartbeat_timeout_ms="
            f"{lighthouse.heartbeat_timeout_ms} (to drop a dead "
            f"group) + join_timeout_ms={lighthouse.join_timeout_ms} "
            f"(to admit a slow one) + quorum_tick_ms={lighthouse.quorum_tick_ms} "
            f"= {lighthouse_wait_s(lighthouse):g} s, "
            f"so a quorum after a fault would time out. Fix: quorum_timeout_s >= "
            f"{MARGIN * lighthouse_wait_s(lighthouse):g}, or "
            "shorter --heartbeat-timeout-ms / --join-timeout-ms."
        )


def check_lighthouse_timeouts(lighthouse: LighthouseTimeouts) -> str | None:
    """The launcher's side: the message of an inconsistent set (flag, value, fix), or ``None``."""
    hb, tick = lighthouse.heartbeat_timeout_ms, lighthouse.quorum_tick_ms
    if hb < 2 * HEARTBEAT_INTERVAL_MS:
        return (
            f"--heartbeat-timeout-ms {hb}: the groups heartbeat "
            f"every {HEARTBEAT_INTERVAL_MS} ms, so a live group "
            "would be dropped between two heartbeats. Fix: "
            f"--heartbeat-timeout-ms >= {2 * HEARTBEAT_INTERVAL_MS}."
        )
    if tick > hb:
        return (
            f"--quorum-tick-ms {tick} with --heartbeat-timeout-ms "
            f"{hb}: the lighthouse would notice a dead group "
            f"only on its next tick, so the stall per fault becomes the tick. Fix: --quorum-tick-ms <= {hb}."
        )
    return None
