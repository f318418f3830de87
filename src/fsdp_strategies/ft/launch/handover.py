"""A replica group restarted with no live peer ahead of it resumes from the newest checkpoint, not step 0.

Why: a restarted ``ft_hsdp`` group normally heals from a live group through torchft. When every group went
down (a full job step lost, all groups killed at once), there is no peer left: without a checkpoint to start
from, the restarted groups would train again from step 0.

Rule (:func:`hand_checkpoints`): a peer is *ahead* of group ``g`` when its process runs and its current
incarnation (started at ``live_since[h]``) has committed at least ``g``'s last committed step. With no peer
ahead, ``g`` is handed the checkpoints every group recorded in its events file (``ft_hsdp``'s checkpoint
writer notes each save), newest first, in ``g``'s :func:`~fsdp_strategies.ft.protocol.resume_file`; the
restarted group restores the first that verifies at the end of its ``setup``
(:func:`~fsdp_strategies.ft.heal_state.resume_from_handed`). Beside a peer ahead nothing is handed: the group
heals from it, as always. Used by the FT launcher (``fsdp-strategies-ft``) and, through ``python -m
fsdp_strategies.ft.launch.handover``, by ``examples/slurm/ft_hsdp.sbatch``, whose group loops mark a running
job step with a ``group<g>.running`` file beside the events files (its modification time: the incarnation's
start).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from fsdp_strategies.ft.protocol import EventLog, resume_file

__all__ = ["hand_checkpoints", "main", "running_file"]


def running_file(events_dir: str | Path, group: int) -> Path:
    """The marker a script keeps while group ``group``'s job step runs (``ft_hsdp.sbatch``)."""
    return Path(events_dir) / f"group{group}.running"


def hand_checkpoints(events: Sequence[EventLog], group: int,
                     live_since: Mapping[int, float]) -> tuple[int, str, int] | None:
    """Write ``group``'s resume file when no live peer is ahead; return ``(step, newest, count)`` if handed.

    ``events``: every group's events file, by group id; ``live_since``: for each *other* group whose process
    runs, when its current incarnation started (``time.time()``). The resume file is removed first, so an
    old hand-over is never read by a later incarnation.
    """
    target = resume_file(events[group].path)
    target.unlink(missing_ok=True)
    mine = events[group].last_committed_step()
    if any(h != group and events[h].last_committed_step(since) >= mine for h, since in live_since.items()):
        return None  # a live peer ahead: the restarted group heals from it
    found = sorted({c for log in events for c in log.checkpoints()}, reverse=True)
    if not found:
        return None
    target.write_text("".join(f"{path}\n" for _, path in found))
    return found[0][0], found[0][1], len(found)


def main(argv: list[str] | None = None) -> int:
    """``python -m fsdp_strategies.ft.launch.handover --events PATTERN --group G --groups N --attempt A``
    (before a start of group G: attempt 0 only removes an old hand-over)."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_strategies.ft.launch.handover", description=main.__doc__
    )
    parser.add_argument("--events", required=True,
                        help="the groups' events files, with {replica_group_id} (FSDP_STRATEGIES_FT_EVENTS)")
    parser.add_argument("--group", type=int, required=True, help="the replica group about to start")
    parser.add_argument("--groups", type=int, required=True, help="number of replica groups")
    parser.add_argument("--attempt", type=int, default=1, help="0: its first start (nothing is handed)")
    args = parser.parse_args(argv)
    events = [EventLog(args.events.replace("{replica_group_id}", str(g))) for g in range(args.groups)]
    if args.attempt == 0:
        resume_file(events[args.group].path).unlink(missing_ok=True)
        return 0
    folder = events[args.group].path.parent
    live = {g: running_file(folder, g).stat().st_mtime for g in range(args.groups)
            if g != args.group and running_file(folder, g).exists()}
    handed = hand_checkpoints(events, args.group, live)
    if handed is None:
        print(f"ft_hsdp handover: replica group {args.group} heals from a live peer (or has no checkpoint)")
    else:
        step, newest, count = handed
        print(f"ft_hsdp handover: replica group {args.group} resumes from {newest} (step {step}; {count} "
              "checkpoint(s) handed, newest first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
