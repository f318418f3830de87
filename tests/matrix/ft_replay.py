"""The independent reference of an ``ft_hsdp`` cell: its committed steps replayed in one plain torch process.

What ``ft_hsdp`` should compute, written without torchft, FSDP or Lightning's loop: start from group 0's
initial weights; for each committed step k, the gradient is the mean over the groups that *participated* in it
(a healing group contributes zeros and is not counted, torchft's ``Manager.allreduce``) of the gradient of
each group's own loss on the batch it trained (the sum of the contributors' gradients divided by the quorum's
participant count, which counts a group healing at step 0 that contributes zeros); the optimizer steps once
per committed step and never on a discarded one. The inputs come from ``ft_worker.py``'s records (batches,
per-step outcomes, ``init.pt``); the replay's loss on every participant's batch must equal the loss that group
logged, and its final weights must equal the groups' final weights. A group SIGKILLed in a step leaves no
outcome line for it: the survivors' participant count says whether it had taken part (then its batch for that
position, saved before its forward, stands in for it) or not.
"""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from matrix.models import MODELS


def _records(out: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for p in sorted(out.glob("steps_g*.jsonl")) for line in p.read_text().splitlines()
    ]


def committed_steps(out: Path) -> dict[int, tuple[list[int], int]]:
    """Committed step k -> (the groups whose gradients made it, the participant count the gradients' sum was
    divided by), read from the records (see the module docstring)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in _records(out):
        if r["committed"] and r["step_after"] == r["position"] + 1:
            by_step[r["step_after"]].append(r)
    steps: dict[int, tuple[list[int], int]] = {}
    for k, rs in sorted(by_step.items()):
        counts = {r["participants"] for r in rs}
        if len(counts) != 1:
            raise AssertionError(f"step {k}: groups disagree on the participant count {sorted(counts)}")
        count = counts.pop()
        contributors = {r["group"] for r in rs if r["participating"]}
        # a group that began this position and wrote no outcome died in the step: before the quorum/all-reduce
        # (not counted) or after the commit (counted and contributed); the agreed count tells which
        silent = {int(p.name.split("_")[1][1:]) for p in out.glob(f"batch_g*_s{k - 1}.pt")} - {
            r["group"] for r in rs
        }
        # zeros; counted at step 0 (init sync) only
        healing = {r["group"] for r in rs if not r["participating"]}
        missing = count - len(contributors) if silent else 0
        if (
            not contributors
            or count < len(contributors)
            or (silent and healing)
            or missing not in (0, len(silent))
        ):
            raise AssertionError(
                f"step {k}: {sorted(contributors)} took part, {sorted(silent)} wrote no record, "
                f"but {count} participants were counted"
            )
        steps[k] = (sorted(contributors | (silent if missing else set())), count)
    return steps


def replay(model_name: str, out: Path, lr_scale: float = 1.0) -> dict[str, Any]:
    """Replay the committed steps; returns the largest relative loss and weight differences from the
    groups'."""
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    model.load_state_dict(torch.load(out / "init.pt", weights_only=True))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer), (
        "the replay handles a bare optimizer (the matrix models')"
    )
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    logged = {
        (r["group"], r["position"]): r["loss"] for r in _records(out) if r["participating"] and r["committed"]
    }
    steps = committed_steps(out)
    if sorted(steps) != list(range(1, len(steps) + 1)):
        raise AssertionError(f"committed steps are not 1..N: {sorted(steps)}")
    loss_dev, compared = 0.0, 0
    for k, (groups, count) in steps.items():
        optimizer.zero_grad()
        losses = []
        for g in groups:
            batch = torch.load(out / f"batch_g{g}_s{k - 1}.pt", weights_only=True)
            # self.log() outside a Trainer: nothing to log to, as intended here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = model.training_step(batch, k - 1)
            losses.append(loss)
            if (g, k - 1) in logged:
                ref = logged[(g, k - 1)]
                loss_dev = max(loss_dev, abs(loss.item() - ref) / max(abs(ref), 1e-8))
                compared += 1
        (torch.stack(losses).sum() / count).backward()  # torchft: the sum over contributors / participants
        optimizer.step()
    weight_dev = 0.0
    finals = sorted(out.glob("final_g*.pt"))
    for f in finals:
        theirs = torch.load(f, weights_only=True)
        for name, p in model.state_dict().items():
            diff = (p.float() - theirs[name].float()).abs().max().item()
            weight_dev = max(weight_dev, diff / max(theirs[name].float().abs().max().item(), 1e-8))
    return {"steps": len(steps), "participants": steps, "loss_deviation": loss_dev,
            "losses_compared": compared, "weight_deviation": weight_dev, "finals": len(finals)}
