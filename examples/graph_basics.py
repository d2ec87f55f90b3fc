"""The first two usage styles of the NPUGraph documentation, on whichever backend is chosen.

    python examples/graph_basics.py                 # auto: npu, else cuda, else the CPU emulator
    NPUGRAPH_BACKEND=emulate python examples/graph_basics.py
"""
import sys

import torch

import npugraph_train.graphed as ng


def main() -> None:
    backend = ng.get_backend()
    device = backend.device_type
    print(f"backend: {backend.name}")

    # Style 1: the graph class with capture_begin/capture_end on a user-made stream.
    a = torch.ones(1000, device=device)
    g = ng.Graph()
    s = ng.new_stream()
    with ng.stream(s):
        g.capture_begin()
        b = a
        for _ in range(10):
            b = b + 1
        g.capture_end()
    g.replay()
    ng.synchronize()
    print(f"capture_begin/capture_end: b.sum().item() == {b.sum().item()}")

    # Style 2: the graph context manager.
    a = torch.ones(1000, device=device)
    g2 = ng.Graph()
    with ng.graph(g2):
        b = a
        for _ in range(10):
            b = b + 1
    g2.replay()
    ng.synchronize()
    print(f"graph context manager:     b.sum().item() == {b.sum().item()}")


if __name__ == "__main__":
    try:
        main()
    except ng.BackendUnavailableError as exc:
        sys.exit(f"error: {exc}")
