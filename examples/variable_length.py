"""Updating captured op arguments without re-capture: variable-length batches through one graph.

A custom op (``torch.library``) takes the true lengths of a padded batch as a host list, like the
sequence lengths of Ascend's fused attention kernels: a captured graph bakes them in, and copying into
device buffers cannot change them. Registered as updatable, its host arguments are refreshed before
each replay (torch_npu's NPUGraph ``update`` step), so batches of fixed padded shape and varying true
lengths replay one forward and one backward graph.

    python examples/variable_length.py            # graphed, with per-batch updates; checked against eager
    python examples/variable_length.py --eager    # the same training without graphs

The op's implementation here is a stand-in written with torch ops, so that it runs on the emulator; on
an NPU the same handler mechanism drives kernels such as ``npu_fused_infer_attention_score``. There,
``update`` re-issues each recorded op as one kernel in a CANN task group, so an updatable op must be a
single aclnn kernel: this composite stand-in (which also copies the lengths to the device) shows the
mechanism and is not one to capture on an NPU.
"""
import argparse
import sys
from typing import List, Tuple

import torch
import torch.nn as nn

import npugraph_train.graphed as ng
from npugraph_train.graphed.handlers import GraphOpHandler, register_graph_handler


@torch.library.custom_op("npugraph_demo::masked_mean", mutates_args=())
def masked_mean(x: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """Mean over the first ``lengths[b]`` positions of each row of a padded ``(batch, seq, dim)`` tensor."""
    mask = torch.arange(x.shape[1], device=x.device) < torch.tensor(lengths, device=x.device)[:, None]
    return (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


@torch.library.custom_op("npugraph_demo::masked_mean_backward", mutates_args=())
def masked_mean_backward(grad: torch.Tensor, x: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    mask = torch.arange(x.shape[1], device=x.device) < torch.tensor(lengths, device=x.device)[:, None]
    return grad[:, None, :] * mask[..., None] / mask.sum(1)[:, None, None]


@masked_mean.register_fake
def _(x: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[2])


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.lengths = inputs[1]


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    return torch.ops.npugraph_demo.masked_mean_backward(grad, x, ctx.lengths), None


masked_mean.register_autograd(_backward, setup_context=_setup_context)


@register_graph_handler(["masked_mean.default", "masked_mean_backward.default"])
class MaskedMeanHandler(GraphOpHandler):
    """Both ops take ``lengths`` positionally: argument 1 of the forward, 2 of the backward."""

    UPDATE_SPECS = {"masked_mean.default": [("arg", 1, "lengths")],
                    "masked_mean_backward.default": [("arg", 2, "lengths")]}


class VarLenRegressor(nn.Module):
    """Projection, masked mean over the true lengths, head. ``lengths`` is set per batch."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, 1)
        self.lengths: List[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.ops.npugraph_demo.masked_mean(torch.tanh(self.proj(x)), self.lengths))


def batches(steps: int, batch: int, seq: int, dim: int, seed: int = 1) -> List[Tuple[torch.Tensor, List[int],
                                                                                       torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, seq + 1, (batch,), generator=g).tolist()
        out.append((torch.randn(batch, seq, dim, generator=g), lengths, torch.randn(batch, 1, generator=g)))
    return out


def train(graphed: bool, steps: int = 12, batch: int = 4, seq: int = 10, dim: int = 8) -> Tuple[VarLenRegressor,
                                                                                                List[float]]:
    """SGD on padded batches with varying true lengths; returns the model and the losses."""
    device = ng.get_backend().device_type
    torch.manual_seed(0)
    model = VarLenRegressor(dim).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(steps, batch, seq, dim)
    if graphed:
        model.lengths = [seq] * batch  # the capture-time values; every replay gets its own by update
        ng.make_graphed_callables(model, (torch.zeros(batch, seq, dim, device=device),), auto_dispatch_capture=True)
    losses = []
    for x, lengths, y in data:
        model.lengths = lengths  # what the eager forward (and eager fallbacks) read
        if graphed:
            ng.graphed_state(model).update([{"lengths": lengths}])
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="train without graphs")
    args = parser.parse_args()
    model, losses = train(not args.eager)
    print(f"backend: {ng.current_backend()}, {'eager' if args.eager else 'graphed with per-batch updates'}")
    for i, loss in enumerate(losses):
        print(f"step {i}: loss {loss:.6f}")
    if not args.eager:
        print(f"replays: {ng.graphed_state(model).report()['replays']}")
        eager_model, eager_losses = train(False)
        same = losses == eager_losses and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                                 eager_model.state_dict().values()))
        print(f"losses and parameters bitwise equal to the same training without graphs: {same}")


if __name__ == "__main__":
    try:
        main()
    except (ng.BackendUnavailableError, NotImplementedError) as exc:
        sys.exit(f"error: {exc}")
