import types

import pytest
import torch
import torch.nn as nn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import npugraph_train.graphed as ng
from npugraph_train.optim import (CapturableOptimizer, check_capture_safe, clip_grad_norm_, make_capturable, plain_lr,
                                  plain_scheduler_state)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _grads(steps):
    torch.manual_seed(1)
    return [[torch.randn(8, 6), torch.randn(8), torch.randn(1, 8), torch.randn(1)] for _ in range(steps)]


def _set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad.copy_(g) if p.grad is not None else setattr(p, "grad", g.clone())


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=False),
    "SGD-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
    "Adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, fused=True),
    **{cls.__name__: (lambda cls: lambda ps: cls(ps, lr=0.01))(cls) for cls in (
        torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD,
        torch.optim.Adadelta)},
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_captured_step_replays_like_eager_with_scheduler(name):
    grads = _grads(12)

    def run(graphed):
        model = _model()
        opt = make_capturable(OPTIMIZERS[name](model.parameters()))
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        _set_grads(model, grads[0])
        opt.step()  # first step eager: creates the optimizer state
        sched.step()
        if graphed:
            g = ng.Graph()
            with ng.graph(g):
                opt.step()
        for step_grads in grads[1:]:
            _set_grads(model, step_grads)
            g.replay() if graphed else opt.step()
            sched.step()
        return model, opt.param_groups[0]["lr"]

    (eager, eager_lr), (graphed, graphed_lr) = run(False), run(True)
    for a, b in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(eager_lr, graphed_lr) and graphed_lr.item() < OPTIMIZERS[name]([torch.zeros(1)]).defaults[
        "lr"] / 8, "the scheduler's decay reached the captured step"


def test_non_capturable_adam_is_caught_on_the_emulator():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _set_grads(model, _grads(1)[0])
    opt.step()
    with pytest.raises(ng.GraphCaptureError, match=r"_local_scalar_dense.*in Adam.step\(\), not made capture-safe, "
                                                   r"which reads its step count .*make_capturable\(optimizer\)"):
        with ng.graph(ng.Graph()):
            opt.step()
    with pytest.raises(MisconfigurationException, match="Adam with capturable=False"):
        check_capture_safe(opt, tensor_lr_needed=False)
    make_capturable(opt)
    with ng.graph(ng.Graph()):
        opt.step()  # converted: captures


def test_make_capturable_keeps_state_and_object():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _set_grads(model, _grads(1)[0])
    opt.step()
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert make_capturable(opt) is opt
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, CapturableOptimizer)
    assert [opt.state[p]["momentum_buffer"] for p in model.parameters()] == buffers
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0 and lr.item() == pytest.approx(0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1, 0.5).step()
    assert opt.param_groups[0]["lr"] is lr, "schedulers update the lr tensor in place"
    assert make_capturable(opt) is opt and opt.param_groups[0]["lr"] is not None  # idempotent


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.1)])
def test_step_hooks_survive_conversion(make):
    model = _model()
    opt = make(model.parameters())
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    _set_grads(model, _grads(1)[0])
    make_capturable(opt).step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("name", ["SGD-nesterov", "AdamW"])
def test_converted_optimizers_pickle_and_keep_training_alike(name):
    import pickle

    model = _model()
    opt = make_capturable(OPTIMIZERS[name](model.parameters()))
    grads = _grads(3)
    _set_grads(model, grads[0])
    opt.step()
    model_copy, opt_copy = pickle.loads(pickle.dumps((model, opt)))  # torch.save pickles it the same way
    assert type(opt_copy) is type(opt) and opt_copy.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for g in grads[1:]:
        for m, o in ((model, opt), (model_copy, opt_copy)):
            _set_grads(m, g)
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_copy.parameters()))


def test_adam_state_steps_move_to_parameter_device_and_capturable_flag():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _set_grads(model, _grads(1)[0])
    opt.step()
    make_capturable(opt)
    assert all(g["capturable"] for g in opt.param_groups)
    assert all(opt.state[p]["step"].dtype == torch.float32 for p in model.parameters())


def test_torch_npu_fused_optimizer_is_refused():
    NpuFusedAdamW = type("NpuFusedAdamW", (torch.optim.Optimizer,), {"__module__": "torch_npu.optim.npu_fused_adamw"})
    opt = NpuFusedAdamW(_model().parameters(), {"lr": 0.1})
    with pytest.raises(MisconfigurationException, match=r"NpuFusedAdamW \(torch_npu\).*torch.optim.AdamW\(\.\.\., "
                                                        r"foreach=True\)"):
        make_capturable(opt)
    NpuFusedLamb = type("NpuFusedLamb", (torch.optim.Optimizer,), {"__module__": "torch_npu.optim.npu_fused_lamb"})
    with pytest.raises(MisconfigurationException, match=r"Use a torch.optim optimizer \(e.g. AdamW\)\(\.\.\., "):
        make_capturable(NpuFusedLamb(_model().parameters(), {"lr": 0.1}))


def test_unknown_and_fused_optimizers_are_refused():
    with pytest.raises(MisconfigurationException, match="LBFGS is not known to be capture-safe.*Use one of them, "
                                                        "or, with NPUGraphCallback, use mode='submodules'"):
        make_capturable(torch.optim.LBFGS(_model().parameters()))
    with pytest.raises(TypeError, match="make_capturable takes a torch.optim.Optimizer .* got Linear"):
        make_capturable(nn.Linear(2, 2))
    with pytest.raises(MisconfigurationException, match="Adagrad is not known to be capture-safe"):
        make_capturable(torch.optim.Adagrad(_model().parameters(), fused=True))


@pytest.mark.parametrize("make", [
    lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
    lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, dampening=0.1, maximize=True, fused=True),
    lambda ps, lr: torch.optim.SGD(ps, lr=lr, fused=True),
    lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, fused=True),
], ids=["sgd-nesterov", "sgd-dampening", "sgd-plain", "adamw"])
def test_a_converted_fused_optimizer_runs_torchs_fused_kernel(make):
    # The same arithmetic as torch's own fused optimizer with a float32 device lr: bitwise, step after step.
    models = [_model(), _model()]
    torch_own, converted = make(models[0].parameters(), torch.tensor(0.05)), make_capturable(
        make(models[1].parameters(), 0.05))
    check_capture_safe(torch.optim.SGD(models[0].parameters(), lr=torch.tensor(0.05), fused=True),
                       tensor_lr_needed=True)  # torch's fused SGD reads a tensor lr on the device
    for grads in _grads(6):
        for model, opt in zip(models, (torch_own, converted)):
            _set_grads(model, grads)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))


def test_fused_sgd_gives_a_parameter_first_used_later_its_first_step():
    # torch's own fused SGD fails when only some parameters have a momentum buffer; the converted one steps them
    # as torch's foreach SGD does.
    def run(fused):
        model = _model()
        opt = make_capturable(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused))
        for step, grads in enumerate(_grads(4)):
            _set_grads(model, grads)
            if step == 0:
                model[2].bias.grad = None  # unused on the first step
            opt.step()
        return model

    for a, b in zip(run(None).parameters(), run(True).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # foreach and fused kernels: last bits


def test_fused_adamw_is_refused_on_npu_also_once_converted():
    opt = make_capturable(torch.optim.AdamW(_model().parameters(), lr=0.01, fused=True))
    # Parameters moved to an NPU after a first conversion (the double's tensors live on the CPU).
    opt.param_groups[0]["params"] = [types.SimpleNamespace(device=types.SimpleNamespace(type="npu"))]
    for refuse in (make_capturable, lambda o: check_capture_safe(o, tensor_lr_needed=True)):
        with pytest.raises(MisconfigurationException, match=r"AdamW\(fused=True\) cannot be captured on an NPU: "
                                                            r"torch_npu's fused kernels are not known to be "
                                                            r"capture-safe.*foreach=True"):
            refuse(opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adamw_keeps_its_kernel_with_float32_lr_and_steps(dtype):
    # torch's fused kernels read the lr and step count on the device, in float32 (CUDA's reads a float*).
    model = _model().to(dtype)
    opt = make_capturable(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    _set_grads(model, [g.to(dtype) for g in _grads(1)[0]])
    opt.step()
    group = opt.param_groups[0]
    assert group["fused"] and group["capturable"] and not group["foreach"]
    assert group["lr"].dtype == torch.float32
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())
    check_capture_safe(opt, tensor_lr_needed=True)
    check_capture_safe(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True, capturable=True),
                       tensor_lr_needed=True)  # torch's own fused capturable AdamW: capture-safe as it is
    with pytest.raises(MisconfigurationException, match="AdamW with capturable=False is refused by torch's "
                                                        "capture check on CUDA.*Pass capturable=True"):
        check_capture_safe(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True),
                           tensor_lr_needed=True)
    if dtype == torch.float64:  # a float64 lr tensor: CUDA's fused kernel refuses it
        with pytest.raises(MisconfigurationException, match=r"AdamW\(fused=True\) has a torch.float64 lr tensor on "
                                                            r"cpu: .*Pass lr=torch.tensor\(lr, dtype=torch.float32, "
                                                            r"device='cpu'\)"):
            check_capture_safe(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, dtype=dtype), fused=True,
                                                 capturable=True), tensor_lr_needed=True)


def test_fused_adamw_with_tensor_betas_is_refused_with_the_fix():
    # Its kernel takes betas as host values: each step would read the tensors (a sync, refused in a capture).
    opt = torch.optim.AdamW(_model().parameters(), lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.99)),
                            fused=True)
    with pytest.raises(MisconfigurationException, match=r"AdamW\(fused=True\) with tensor betas: .*Pass betas as "
                                                        r"floats"):
        make_capturable(opt)
    assert not isinstance(opt, CapturableOptimizer), "refused before anything changed"
    # A group added to a converted optimizer is refused alike, and taken out again.
    opt = make_capturable(torch.optim.AdamW(_model().parameters(), lr=0.01, fused=True))
    with pytest.raises(MisconfigurationException, match="with tensor betas"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "betas": (torch.tensor(0.9), 0.99)})
    assert len(opt.param_groups) == len(opt._plain_settings) == 1
    # Tensor betas of a group that is not fused are not the fused kernel's (torch's capturable step reads them).
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "betas": (torch.tensor(0.9), 0.99), "fused": False})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["foreach"]


def test_an_unconverted_optimizer_with_fused_and_foreach_groups_is_checked_per_group():
    opt = torch.optim.AdamW(_model().parameters(), lr=torch.tensor(0.01), fused=True, capturable=True)
    check_capture_safe(opt, tensor_lr_needed=True)  # fused on the CPU: capture-safe as it is
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "fused": False, "foreach": True,
                         "capturable": False})
    with pytest.raises(MisconfigurationException, match="AdamW with capturable=False keeps its step count on the host"):
        check_capture_safe(opt, tensor_lr_needed=True)
    opt.param_groups[1]["capturable"] = True
    with pytest.raises(MisconfigurationException, match=r"AdamW\(capturable=True\) refuses CPU tensors in torch"):
        check_capture_safe(opt, tensor_lr_needed=True)  # torch's foreach step would refuse the CPU tensors


class MySGD(torch.optim.SGD):
    """A subclass that keeps SGD.step."""


def test_an_sgd_subclass_is_converted_with_the_device_lr_step_and_one_overriding_step_is_refused():
    def train(make, graphed):
        model = _model()
        opt = make_capturable(make(model.parameters(), lr=0.1, momentum=0.9))
        g = ng.Graph()
        for i, step_grads in enumerate(_grads(3)):
            _set_grads(model, step_grads)
            if graphed and i == 1:  # (after an eager step made the momentum buffers)
                with ng.graph(g):  # SGD's own step would read the lr on the host here
                    opt.step()
            g.replay() if graphed and i >= 1 else opt.step()
        return model

    reference = train(torch.optim.SGD, False)
    for graphed in (False, True):
        converted = train(MySGD, graphed)
        assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), converted.parameters()))

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    with pytest.raises(MisconfigurationException, match="OwnStep overrides SGD.step.*subclass npugraph_train.optim."
                                                        "CapturableSGD"):
        make_capturable(OwnStep(_model().parameters(), lr=0.1))


def test_clip_grad_norm_takes_torchs_arguments():
    grads = _grads(1)[0]
    norms = []
    for clip in (torch.nn.utils.clip_grad_norm_, clip_grad_norm_):
        model = _model()
        _set_grads(model, [g * 5 for g in grads])
        norms.append(clip(model.parameters(), "1.0" if clip is clip_grad_norm_ else 1.0, norm_type="inf",
                          error_if_nonfinite=False, foreach=True))
    assert torch.equal(*norms)
    with pytest.raises(ValueError, match=r"error_if_nonfinite=True\) reads the norm on the host.*leave it False"):
        clip_grad_norm_(_model().parameters(), 1.0, error_if_nonfinite=True)


def test_non_capturable_adam_refusal_names_the_fixes_that_work_on_its_device():
    # on CPU tensors (the emulator) torch refuses capturable=True, which the message suggested
    cpu = torch.optim.Adam(_model().parameters(), lr=0.01)
    with pytest.raises(MisconfigurationException) as info:
        check_capture_safe(cpu, tensor_lr_needed=False)
    assert "Convert it with npugraph_train.optim.make_capturable(optimizer) (NPUGraphCallback does it unless you " \
           "pass convert_optimizers=False: remove that) (torch's own capturable=True refuses" in str(info.value)
    assert "Pass capturable=True" not in str(info.value)
    device = torch.optim.Adam(nn.Linear(2, 2, device="meta").parameters(), lr=0.01)
    with pytest.raises(MisconfigurationException, match="Pass capturable=True, or convert it with npugraph_train.optim."
                                                        "make_capturable.*remove that"):
        check_capture_safe(device, tensor_lr_needed=False)


def test_clip_grad_norm_matches_torch_and_captures():
    grads = _grads(4)

    def run(clip, graphed):
        model = _model()
        _set_grads(model, grads[0])
        norms = []
        if graphed:
            g = ng.Graph()
            with ng.graph(g):
                norm = clip(model.parameters(), 1.0)
        for step_grads in grads:
            _set_grads(model, [x * 5 for x in step_grads])
            if graphed:
                g.replay()
                norms.append(norm.clone())
            else:
                norms.append(clip(model.parameters(), 1.0))
        return norms, [p.grad for p in model.parameters()]

    torch_norms, torch_grads = run(torch.nn.utils.clip_grad_norm_, False)
    ours_norms, ours_grads = run(clip_grad_norm_, True)
    assert all(torch.equal(a, b) for a, b in zip(torch_norms, ours_norms))
    assert all(torch.equal(a, b) for a, b in zip(torch_grads, ours_grads))


def test_whole_step_through_the_npu_double(npu_double, monkeypatch):
    from npugraph_train import NPUGraphCallback
    from npugraph_train.callbacks import npu_graph

    # The double's "NPU" runs on the CPU, where the callback would otherwise refuse npu graphs.
    monkeypatch.setattr(npu_graph, "backend_for_device", lambda device, name: ng.get_backend(name))

    from .lightning_models import fit
    from .test_whole_step import Scheduled
    import tests.lightning_models as models

    original = models.Regressor
    models.Regressor = Scheduled
    try:
        callback = NPUGraphCallback(mode="whole_step", capture_error_mode="relaxed")
        graphed, _ = fit(callbacks=[callback], max_steps=8)
        import os
        os.environ["NPUGRAPH_BACKEND"] = "emulate"
        eager, _ = fit(max_steps=8)
    finally:
        models.Regressor = original
    assert callback.report()[0]["replays"] == 5
    calls = [c for c in npu_double if c[0] == "graph"]
    assert len(calls) == 1 and calls[0][2]["capture_error_mode"] == "relaxed"
    assert calls[0][2]["auto_dispatch_capture"] is False
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), graphed.state_dict().values()))


def test_checkpoint_round_trip_and_new_groups_stay_capture_safe():
    opt = make_capturable(torch.optim.AdamW(_model().parameters(), lr=1e-3))
    saved = opt.state_dict()["param_groups"][0]
    assert isinstance(saved["lr"], float) and saved["capturable"] is False  # as the plain optimizer writes it
    opt.load_state_dict(opt.state_dict())  # e.g. fit(ckpt_path=...) with make_capturable in configure_optimizers
    check_capture_safe(opt, tensor_lr_needed=True)
    assert opt.param_groups[0]["capturable"] and isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.5})
    assert opt.param_groups[1]["capturable"] and isinstance(opt.param_groups[1]["lr"], torch.Tensor)
    assert opt.state_dict()["param_groups"][1]["lr"] == 0.5


@pytest.mark.parametrize("written", [1e-3, 3e-4, 0.1, 2.5e-5, 1 / 3, 0.009045084971874737])
def test_plain_lr_is_the_shortest_decimal_of_the_float32(written):
    lr = torch.tensor(written, dtype=torch.float32)
    plain = plain_lr(lr)
    assert torch.tensor(plain, dtype=torch.float32).item() == lr.item(), "restoring it gives the same lr tensor"
    assert len(repr(plain)) <= len(repr(written)) and len(repr(plain)) < len(repr(lr.item()))
    assert plain_lr(written) == written, "a float lr is already plain"


def test_float64_parameters_get_a_float64_lr_written_back_exactly():
    model = _model().double()  # precision="64-true"
    written = 0.009045084971874737  # a cosine schedule's value: not a float32
    opt = make_capturable(torch.optim.SGD(model.parameters(), lr=written, momentum=0.9))
    lr = opt.param_groups[0]["lr"]
    assert lr.dtype == torch.float64 and lr.item() == written, "not rounded to float32"
    assert plain_lr(lr) == written and opt.state_dict()["param_groups"][0]["lr"] == written
    assert make_capturable(torch.optim.SGD(_model().parameters(), lr=0.1)).param_groups[0]["lr"].dtype == torch.float32


@pytest.mark.parametrize("name", ["AdamW", "Adamax"])
def test_float64_parameters_count_steps_in_float64(name):
    # A capturable step computes bias corrections from the step count on the device (a plain one on the host,
    # in double): float32 counts put float64 training off by about 1e-6. (NAdam's and RAdam's capturable
    # formulas differ from their plain ones anyway, by about 1e-10.)
    models = [_model().double() for _ in range(2)]
    plain, converted = OPTIMIZERS[name](models[0].parameters()), make_capturable(OPTIMIZERS[name](
        models[1].parameters()))
    for grads in _grads(12):
        for model, opt in zip(models, (plain, converted)):
            _set_grads(model, [g.double() for g in grads])
            opt.step()
    assert all(s["step"].dtype == torch.float64 for s in converted.state.values())
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_scheduler_states_become_plain_also_when_chained():
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": torch.tensor(0.5)}], lr=1e-3,
                            capturable=True)
    make_capturable(opt)  # the second group's lr was the user's tensor
    scheduler = SequentialLR(opt, [LinearLR(opt, 0.5, total_iters=2), CosineAnnealingLR(opt, 4)], milestones=[2])
    for _ in range(3):
        opt.step()
        scheduler.step()
    state = plain_scheduler_state(scheduler, scheduler.state_dict())
    for part in [state] + state["_schedulers"]:
        first, second = zip(*(part[key] for key in ("base_lrs", "_last_lr") if key in part))
        assert all(type(lr) is float for lr in first) and all(isinstance(lr, torch.Tensor) for lr in second)
    assert state["_schedulers"][0]["base_lrs"][0] == 1e-3
