"""One job of the pretrained_load suite: get a pretrained HF model onto the ranks, measure each rank's peak
memory.

Started by ``torchrun`` (``benchmarks/suites/pretrained_load.py``); every rank measures its own process:

1. everything the routes import (torch, Lightning, transformers, the Llama modelling code, safetensors, DCP,
   FSDP, fsdp_strategies' HF loading) is imported first, so no route pays for an import inside the window;
2. at a fixed point before the model exists, the kernel's peak counter is reset (``echo 5 >
   /proc/self/clear_refs`` sets VmHWM to the current RSS) and VmRSS is read: the Lightning routes in a
   Callback's ``setup`` (before ``configure_model`` and the strategy's setup), ``init_from_pretrained`` and
   ``transformers_single`` just before the model is constructed (the process group already started);
3. at ``on_fit_start`` (the model loaded, sharded or wrapped: ready to train) VmHWM is read: the peak RSS
   growth of the window is ``VmHWM - VmRSS(at 2)``. VmHWM counts anonymous and file-backed pages together
   (safetensors are memory-mapped: the pages a rank touches count while mapped); a thread samples
   ``/proc/self/status`` every 2 ms for the split (``RssAnon``/``RssFile`` peaks, lower bounds: a peak shorter
   than the period can be missed);
4. then the loaded weights are checked: the loss of the reference batch (``--ref``: the same tokens on every
   rank) must equal the loss the suite computed with plain ``transformers`` on the model it saved --
   so a broken load (random weights, a wrong shard) fails the job instead of looking cheap;
5. one training step (``max_steps=1``) runs, and rank 0 writes every rank's record to ``--out``.

Routes (``--contender``):
  fsdp2_configure_model  ``from_pretrained`` in ``configure_model`` under ``fsdp2``: meta build, shard, read
                         own shards
  fsdp2_yaml             ``from_config`` in ``configure_model`` + ``FSDP2Strategy(pretrained=DIR)``
  init_from_pretrained   ``from_pretrained`` in the LightningModule's ``__init__``, Lightning's ``ddp`` (full
                         model on every rank; the window also covers DDP's wrapping, reported apart as
                         ``after_init``)
  transformers_single    ``AutoModelForCausalLM.from_pretrained`` in one plain process (the size reference;
                         also measured after the reference forward, ``after_forward``: its weights stay
                         memory-mapped and untouched until used)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src")]

import lightning.pytorch as pl  # noqa: E402
import safetensors.torch  # noqa: E402, F401  (imported before the window, as every route uses it)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
import transformers  # noqa: E402
import transformers.models.llama.modeling_llama  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import fsdp_strategies  # noqa: E402  (registers the strategy names)
import fsdp_strategies.hf.from_pretrained  # noqa: E402
import fsdp_strategies.hf.pretrained  # noqa: E402, F401
from fsdp_strategies import FSDP2Strategy  # noqa: E402

CONTENDERS = ("fsdp2_configure_model", "fsdp2_yaml", "init_from_pretrained", "transformers_single")
LIGHTNING = CONTENDERS[:3]
SAMPLE_S = 0.002


# ---------------------------------------------------------------------------------------------- memory
def status() -> dict[str, int]:
    """The memory lines of ``/proc/self/status`` in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Window:
    """The measured window: reset the peak counter and read the start at :meth:`start`, the peak at
    :meth:`peak`."""

    def __init__(self) -> None:
        self.start_status: dict[str, int] = {}
        self.marks: dict[str, dict[str, int]] = {}
        self.max_anon = self.max_file = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            s = status()
            self.max_anon = max(self.max_anon, s["RssAnon"])
            self.max_file = max(self.max_file, s["RssFile"])
            time.sleep(SAMPLE_S)

    def start(self) -> None:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start_status = status()
        self.max_anon, self.max_file = self.start_status["RssAnon"], self.start_status["RssFile"]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()

    def mark(self, name: str) -> None:
        """The peaks so far (e.g. right after ``__init__`` loaded the model), without ending the window."""
        now, s0 = status(), self.start_status
        self.marks[name] = {"peak_growth_bytes": now["VmHWM"] - s0["VmRSS"],
                            "peak_anon_growth_bytes": max(self.max_anon, now["RssAnon"]) - s0["RssAnon"],
                            "peak_file_growth_bytes": max(self.max_file, now["RssFile"]) - s0["RssFile"],
                            "anon_growth_bytes": now["RssAnon"] - s0["RssAnon"],
                            "file_growth_bytes": now["RssFile"] - s0["RssFile"]}

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        end = status()
        s0 = self.start_status
        return {
            "peak_growth_bytes": end["VmHWM"] - s0["VmRSS"],
            "peak_anon_growth_bytes": max(self.max_anon, end["RssAnon"]) - s0["RssAnon"],
            "peak_file_growth_bytes": max(self.max_file, end["RssFile"]) - s0["RssFile"],
            "end_growth_bytes": end["VmRSS"] - s0["VmRSS"],
            "end_anon_growth_bytes": end["RssAnon"] - s0["RssAnon"],
            "end_file_growth_bytes": end["RssFile"] - s0["RssFile"],
            "rss_at_start_bytes": s0["VmRSS"],
            "load_s": time.perf_counter() - self.t0,
            "marks": self.marks,
        }


# ---------------------------------------------------------------------------------------------- model + data
class Tokens(Dataset):
    def __init__(self, vocab: int, seq: int, n: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LoadLM(pl.LightningModule):
    """A causal LM from a ``save_pretrained`` folder, built the way ``route`` says."""

    def __init__(self, folder: str, route: str, window: Window | None = None) -> None:
        super().__init__()
        self.folder, self.route = folder, route
        self.model: Any = None
        if route == "init_from_pretrained":
            self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            if window is not None:
                window.mark("after_init")

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.route == "fsdp2_configure_model":
            self.model = transformers.AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32)
        else:  # fsdp2_yaml: random structure here, the strategy's pretrained= option fills it
            config = transformers.AutoConfig.from_pretrained(self.folder)
            self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class Probe(pl.Callback):
    """Opens the window in ``setup`` (unless already open), closes it at ``on_fit_start``, checks the
    weights."""

    def __init__(self, window: Window, ref: torch.Tensor) -> None:
        self.window, self.ref = window, ref
        self.memory: dict[str, Any] = {}
        self.ref_loss: float | None = None
        self.train_loss: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.window.start_status:
            self.window.start()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.memory = self.window.stop()
        if pl_module.device.type == "cuda":  # what the load left on the device, at its peak
            self.memory["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(pl_module.device)
        was_training = pl_module.training
        pl_module.eval()
        # through the LightningModule's own __call__: FSDP2's root hooks gather the shards
        with torch.no_grad():
            self.ref_loss = float(pl_module(self.ref.to(pl_module.device)))
        pl_module.train(was_training)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.train_loss = float(outputs["loss"])


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """Bytes of the model as ``transformers`` holds it (every parameter and buffer once) and its largest
    tensor."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    sizes = [t.numel() * t.element_size() for t in tensors]
    return {"params": sum(p.numel() for p in model.parameters()), "model_bytes": sum(sizes),
            "largest_tensor_bytes": max(sizes)}


# ---------------------------------------------------------------------------------------------- routes
def run_single(ns: argparse.Namespace, ref: torch.Tensor) -> dict[str, Any]:
    window = Window()
    window.start()
    model = transformers.AutoModelForCausalLM.from_pretrained(ns.folder, dtype=torch.float32)
    memory = window.stop()
    with torch.no_grad():
        loss = float(model(input_ids=ref, labels=ref).loss)
    # transformers keeps the parameters of an mmap-ed safetensors file that needs no conversion on the
    # mapping, untouched until used: the RSS once the forward has read every weight is the model-size
    # reference
    window.mark("after_forward")
    return {"rank": 0, "memory": memory, "ref_loss": loss, "train_loss": None, **model_facts(model)}


def run_lightning(ns: argparse.Namespace, ref: torch.Tensor) -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    window = Window()
    probe = Probe(window, ref)
    if ns.contender == "init_from_pretrained":
        strategy: Any = "ddp"
    elif ns.contender == "fsdp2_yaml":
        strategy = FSDP2Strategy(pretrained=ns.folder)
    else:
        strategy = FSDP2Strategy()
    trainer = pl.Trainer(accelerator=ns.accelerator, devices=world, num_nodes=1, strategy=strategy,
                         precision="32-true",
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    if ns.contender == "init_from_pretrained":
        # the process group first (Lightning's ddp then finds it started), so that the window opened before
        # __init__ covers the same work as the other routes' window opened in setup: the model, not the group
        dist.init_process_group("gloo")
        window.start()
    module = LoadLM(ns.folder, ns.contender, window)
    data = DataLoader(Tokens(ns.vocab, ns.seq_len, 64), batch_size=1)
    trainer.fit(module, train_dataloaders=data)
    return {"rank": dist.get_rank(), "memory": probe.memory, "ref_loss": probe.ref_loss,
            "train_loss": probe.train_loss, "strategy_class": type(trainer.strategy).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", required=True, choices=CONTENDERS)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--ref", required=True, help="the suite's JSON: input_ids, loss, tolerance")
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"),
                        help="where the Lightning routes put the model (benchmarks/gpu.py: gpu, one rank)")
    ns = parser.parse_args()
    spec = json.loads(Path(ns.ref).read_text())
    ref = torch.tensor(spec["input_ids"])
    ns.ref_loss, ns.tolerance = spec["loss"], spec["tolerance"]
    ns.vocab, ns.seq_len = spec["vocab_size"], ref.shape[1]
    if ns.contender == "transformers_single":
        records = [run_single(ns, ref)]
    else:
        mine = run_lightning(ns, ref)
        records: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)
    bad = [r["rank"] for r in records if r["ref_loss"] is None
           or not math.isfinite(r["ref_loss"]) or abs(r["ref_loss"] - ns.ref_loss) > ns.tolerance]
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(ns.out).write_text(json.dumps({"contender": ns.contender, "per_rank": records,
                                            "ref_loss": ns.ref_loss,
                                            "weights_ok": not bad, "world_size": len(records)}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if bad:
        losses = {r["rank"]: r["ref_loss"] for r in records}
        sys.exit(
            f"{ns.contender}: the loaded weights are not the pretrained ones: reference-batch loss per rank "
            f"{losses} != {ns.ref_loss} (tolerance {ns.tolerance}) on ranks {bad}"
        )


if __name__ == "__main__":
    main()
