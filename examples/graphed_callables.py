"""The NPUGraph documentation's third example: graphed callables with a data-dependent branch between them.

module1 is graphed with an input that needs no grad, module2 and module3 with an input that needs grad;
which of them runs is decided on the host (``tmp.sum().item() > 0``) outside the graphs. The inputs
alternate in sign, so that both branches run, and each graph replays. The script then runs the same
training eager (same seed and data) and prints whether the losses, parameters and branches are bitwise equal.

    python examples/graphed_callables.py            # graphed, then eager for the check, on the chosen backend
    python examples/graphed_callables.py --small    # small sizes (fast on a CPU, as with the emulate backend)
    python examples/graphed_callables.py --eager    # the same script without graphs (no check)
"""
import argparse
import sys
from itertools import chain
from typing import List, Tuple

import torch

import npugraph_train.graphed as ng


def run(graphed: bool, N: int = 640, D_in: int = 4096, H: int = 2048, D_out: int = 1024, iters: int = 10,
        seed: int = 0) -> Tuple[List[float], List[torch.Tensor], List[str]]:
    """Train ``iters`` iterations; returns the losses, the parameters of the three modules (copies) and the
    branch each iteration took."""
    device = ng.get_backend().device_type
    torch.manual_seed(seed)
    module1 = torch.nn.Linear(D_in, H).to(device)
    module2 = torch.nn.Linear(H, D_out).to(device)
    module3 = torch.nn.Linear(H, D_out).to(device)
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(chain(module1.parameters(), module2.parameters(), module3.parameters()), lr=0.1)

    # Sample inputs: the requires_grad state of each must match the real inputs.
    x = torch.randn(N, D_in, device=device)
    h = torch.randn(N, H, device=device, requires_grad=True)
    if graphed:
        module1 = ng.make_graphed_callables(module1, (x,))
        module2 = ng.make_graphed_callables(module2, (h,))
        module3 = ng.make_graphed_callables(module3, (h,))

    # With positive inputs only (the documentation's rand_like), module1's output sums kept one sign and module3
    # never ran: the inputs alternate in sign, shifted away from 0 so that the sums follow, also at small sizes.
    real_inputs = [(torch.rand_like(x) + 1) * (1 if i % 2 == 0 else -1) for i in range(iters)]
    real_targets = [torch.randn(N, D_out, device=device) for _ in range(iters)]
    losses, branches = [], []
    for data, target in zip(real_inputs, real_targets):
        optimizer.zero_grad(set_to_none=True)
        tmp = module1(data)                   # forward ops run as a graph
        if tmp.sum().item() > 0:              # data-dependent branch, on the host, outside the graphs
            tmp = module2(tmp)
            branches.append("module2")
        else:
            tmp = module3(tmp)
            branches.append("module3")
        loss = loss_fn(tmp, target)
        loss.backward()                       # backward ops of module2/3 and module1 run as graphs
        optimizer.step()
        losses.append(loss.item())
    params = [p.detach().clone() for m in (module1, module2, module3) for p in m.parameters()]
    return losses, params, branches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="run without graphs (and without the check)")
    parser.add_argument("--small", action="store_true", help="small sizes (fast on a CPU)")
    args = parser.parse_args()
    sizes = dict(N=16, D_in=32, H=24, D_out=8) if args.small else {}
    print(f"backend: {ng.current_backend()}, {'eager' if args.eager else 'graphed'}")
    losses, params, branches = run(not args.eager, **sizes)
    for i, (loss, branch) in enumerate(zip(losses, branches)):
        print(f"iter {i}: {branch}, loss {loss:.6f}")
    sums = [float(w.sum() + b.sum()) for w, b in zip(params[::2], params[1::2])]  # (weight, bias) per module
    print("parameter sums: " + ", ".join(f"module{i + 1} {s:.6f}" for i, s in enumerate(sums)))
    print(f"branches: module2 {branches.count('module2')}x, module3 {branches.count('module3')}x")
    if not args.eager:
        eager_losses, eager_params, eager_branches = run(False, **sizes)
        same = (losses == eager_losses and branches == eager_branches
                and all(map(torch.equal, params, eager_params)))
        print(f"graphed vs eager (same seed and data): losses, parameters and branches "
              f"{'bitwise equal' if same else 'differ'}")


if __name__ == "__main__":
    try:
        main()
    except ng.BackendUnavailableError as exc:
        sys.exit(f"error: {exc}")
