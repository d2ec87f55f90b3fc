"""Submodule graphs under Lightning DDP: 2 CPU processes (gloo), graphed and eager give the same parameters."""
import json

import torch
from lightning.pytorch import Callback

from npugraph_train import NPUGraphCallback

from .lightning_models import Regressor, fit


class ReportToFile(NPUGraphCallback):
    """Writes each rank's capture report, so the test can see what happened in the spawned processes."""

    def __init__(self, directory, **kwargs):
        super().__init__(**kwargs)
        self.directory = str(directory)

    def on_train_end(self, trainer, pl_module):
        with open(f"{self.directory}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(self.report(), f)
        super().on_train_end(trainer, pl_module)


class LeaveGroup(Callback):
    """Ends the gloo process group in each worker before it exits: left to interpreter shutdown, gloo's
    threads sometimes abort the worker ("terminate called without an active exception"), graphs or not."""

    def teardown(self, trainer, pl_module, stage):
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_ddp_two_processes_graphed_equals_eager(tmp_path):
    ddp = dict(strategy="ddp_spawn", devices=2, max_steps=12)
    eager, _ = fit(callbacks=[LeaveGroup()], **ddp)
    graphed, _ = fit(callbacks=[ReportToFile(tmp_path, warmup_steps=2), LeaveGroup()], **ddp)
    sa, sb = eager.state_dict(), graphed.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.manual_seed(0)
    assert not torch.equal(Regressor().state_dict()["embed.weight"], sb["embed.weight"]), "the model trained"
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["status"] for r in report] == ["graphed", "graphed"]
        assert all(r["replays"] >= 8 for r in report)
