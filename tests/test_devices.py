"""Parity of graphed and eager training on every available backend: the CPU emulator here, and a CUDA GPU
or an Ascend NPU where there is one (those cases skip cleanly elsewhere).

On the emulator the comparison is bitwise. On a device it is bitwise where graphed and eager runs launch
the same kernels on the same data, which holds for these models (Linear, LayerNorm, GELU, SGD/AdamW
foreach, AdamW fused, clipping): a graph replays exactly the kernels of its capture. The fallback tolerance,
rtol=atol=1e-6 in float32 (a few ulps), only admits kernels whose reduction order is not fixed from run
to run (atomics, split-K GEMM heuristics that can pick another algorithm on the capture stream); the
largest difference is printed so that a device run shows whether equality was bitwise.

On a GPU machine: ``python -m pytest -q -s tests/test_devices.py`` (see the README's development section).
"""
import pytest
import torch
import torch.nn as nn

import npugraph_train.graphed as ng
from npugraph_train import NPUGraphCallback
from npugraph_train.optim import make_capturable

from .lightning_models import fit

ACCELERATOR = {"emulate": "cpu", "cuda": "gpu", "npu": "npu"}
DEVICE_TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def assert_parity(expected, actual, backend):
    for name, e in expected.items():
        a = actual[name].to(e.device)
        if backend.name == "emulate":
            assert torch.equal(e, a), name
        elif not torch.equal(e, a):
            print(f"{backend.name}: {name} differs by at most {(e - a).abs().max().item():.3g}")
            torch.testing.assert_close(a, e, **DEVICE_TOLERANCE)


def _mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1)).to(device)


def _data(device, n=12):
    torch.manual_seed(1)
    return [(torch.randn(8, 16, device=device), torch.randn(8, 1, device=device)) for _ in range(n)]


def test_graph_layer_training_step(backend):
    device = backend.device_type
    data = _data(device, 21)

    def run(graphed):
        model = _mlp(device)
        opt = make_capturable(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        x, y = data[0][0].clone(), data[0][1].clone()

        def step():
            opt.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        step()  # warmup: optimizer state and .grad exist before capture
        if graphed:
            g = ng.Graph()
            with ng.graph(g):
                step()
        for bx, by in data[1:]:
            x.copy_(bx)
            y.copy_(by)
            g.replay() if graphed else step()
        ng.synchronize()
        return dict(model.named_parameters())

    assert_parity(run(False), run(True), backend)


def test_graphed_callables(backend):
    device = backend.device_type
    data = _data(device)

    def run(graphed):
        model = _mlp(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if graphed:
            ng.make_graphed_callables(model, (torch.zeros(8, 16, device=device),))
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        ng.synchronize()
        return dict(model.named_parameters())

    assert_parity(run(False), run(True), backend)


def test_callback_submodules(backend):
    kwargs = dict(accelerator=ACCELERATOR[backend.name], max_steps=20)
    eager, _ = fit(**kwargs)
    callback = NPUGraphCallback(warmup_steps=3)
    graphed, _ = fit(callbacks=[callback], **kwargs)
    assert callback.report()[0]["replays"] > 10
    assert_parity(dict(eager.named_parameters()), dict(graphed.named_parameters()), backend)


@pytest.mark.parametrize("fused, accumulate", [(None, 1), (True, 1), (None, 3)],
                         ids=["foreach", "fused", "accumulate"])
def test_callback_whole_step(backend, fused, accumulate):
    # (accumulate: three graphs in one pool, adding to the first one's gradient buffers)
    from .test_whole_step import _run

    if fused and backend.name == "npu":
        pytest.skip("fused=True is refused on NPU (torch_npu has no _fused_adamw_ with a tensor lr)")
    kwargs = dict(accelerator=ACCELERATOR[backend.name], max_steps=20, gradient_clip_val=0.5,
                  accumulate_grad_batches=accumulate)
    eager, _, _ = _run({"optimizer": "adamw", "fused": fused}, None, **kwargs)
    graphed, _, t = _run({"optimizer": "adamw", "fused": fused}, {}, **kwargs)
    assert t.callbacks[-1].report()[0]["replays"] > 10 * accumulate
    assert_parity(dict(eager.named_parameters()), dict(graphed.named_parameters()), backend)


@pytest.mark.parametrize("name, accum", [("mlp", 1), ("mlp", 4), ("conv_bn", 1), ("transformer", 1), ("dropout", 1)])
def test_graphed_callables_models(backend, name, accum):
    from .test_graphed_callables import MODELS

    # dropout on a device: a replay takes the generator's current Philox offset and advances it by what the
    # capture consumed, as eager calls do, and warmup/capture leave the generator as they found it, so the
    # masks are expected to equal eager's.
    make_model, make_batch, sample = MODELS[name]
    device = backend.device_type

    def run(graphed):
        torch.manual_seed(0)
        model = make_model().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        samples = tuple(t.to(device) for t in sample())
        torch.manual_seed(1)
        batches = [tuple(t.to(device) for t in make_batch()) for _ in range(6 * accum)]
        if graphed:
            ng.make_graphed_callables(model, samples)
        for i, (x, y) in enumerate(batches):
            nn.functional.mse_loss(model(x), y).backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
        ng.synchronize()
        return model.state_dict()

    assert_parity(run(False), run(True), backend)
