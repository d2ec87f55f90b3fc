import dataclasses
import inspect
import random
import re
import warnings

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

import npugraph_train as ngt
from npugraph_train import NPUGraphCallback, NPUGraphConfig

from .lightning_models import Block, Regressor, fit, loaders, trainer


def _same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _graphed_forwards(model):
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("model_kwargs", [{}, {"dropout": 0.2, "depth": 3}])
def test_parity_with_plain_lightning(model_kwargs):
    eager, _ = fit(model_kwargs)
    callback = NPUGraphCallback(warmup_steps=3)
    graphed, t = fit(model_kwargs, callbacks=[callback])
    assert t.global_step == 36
    assert _same_params(eager, graphed)
    rows = callback.report()
    assert [r["module"] for r in rows] == [f"blocks.{i}" for i in range(model_kwargs.get("depth", 2))]
    for row in rows:
        assert row["status"] == "graphed"
        # 36 steps: 3 warmup, 29 replays, 4 short last batches (70 = 8 * 8 + 6) run eager
        assert row["replays"] == 29
        reasons = row["eager_calls"]
        assert sum(n for r, n in reasons.items() if "6, 8" in r) == 4
        assert sum(n for r, n in reasons.items() if "train/eval" in r) > 0  # validation every 5 steps
    assert _graphed_forwards(graphed) == [], "original forwards are restored at the end of fit"
    text = callback.format_report()
    assert "blocks.0: graphed; replays 29" in text and "float32[6, 8]" in text


def test_report_is_logged_once_at_the_end_of_fit(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        fit(callbacks=[NPUGraphCallback(warmup_steps=2)], max_steps=6)
    reports = [r for r in caplog.records if "npugraph_train capture report" in r.getMessage()]
    assert len(reports) == 1 and "blocks.1: graphed; replays 4" in reports[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fit(callbacks=[NPUGraphCallback(warmup_steps=2, log_report=False)], max_steps=6)
    assert not any("capture report" in r.getMessage() for r in caplog.records)


def test_bf16_autocast_parity():
    eager, _ = fit(precision="bf16-mixed", max_steps=12)
    callback = NPUGraphCallback(warmup_steps=2)
    graphed, _ = fit(callbacks=[callback], precision="bf16-mixed", max_steps=12)
    assert _same_params(eager, graphed)
    assert "autocast bfloat16" in callback.report()[0]["signatures"][0]["description"]
    assert callback.report()[0]["replays"] == 10 - 1  # one short batch


def test_second_fit_recaptures():
    callback = NPUGraphCallback(warmup_steps=2)
    torch.manual_seed(0)
    graphed, reference = Regressor(), None
    torch.manual_seed(0)
    reference = Regressor()
    train, val = loaders()
    for max_steps in (10, 20):
        trainer([callback], max_steps=max_steps).fit(graphed, train, val)
        assert callback.report()[0]["replays"] > 0
        trainer([], max_steps=max_steps).fit(reference, train, val)
    assert _same_params(reference, graphed)


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    # Checkpoints at epoch ends (validation at epoch end too), so that a resumed run sees the same batches.
    every_epoch = dict(val_check_interval=1.0, enable_checkpointing=True, default_root_dir=tmp_path / "eager")
    eager, _ = fit(max_steps=36, **every_epoch)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    uninterrupted, _ = fit(callbacks=[NPUGraphCallback(), checkpoints], max_steps=36, **every_epoch)
    assert _same_params(eager, uninterrupted)
    saved = torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)
    assert list(saved["state_dict"]) == list(eager.state_dict()), "graphing leaves state_dict keys unchanged"

    torch.manual_seed(0)
    resumed = Regressor()
    callback = NPUGraphCallback()
    train, val = loaders()
    trainer([callback], max_steps=36, val_check_interval=1.0).fit(resumed, train, val,
                                                                  ckpt_path=tmp_path / "epoch=1.ckpt")
    # 18 resumed steps: 3 warmup, 15 replays minus the 2 short last batches
    assert callback.report()[0]["replays"] == 13, "the resumed run captures again after its warmup steps"
    assert _same_params(uninterrupted, resumed)


def test_exception_restores_forwards():
    class Exploding(Regressor):
        def training_step(self, batch, batch_idx):
            if self.global_step == 6:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Exploding()
    callback = NPUGraphCallback(warmup_steps=2)
    train, val = loaders()
    with pytest.raises(RuntimeError, match="boom"):
        trainer([callback]).fit(model, train, val)
    assert _graphed_forwards(model) == []
    assert callback.report()[0]["replays"] == 4  # steps 2-5; step 6 raised before its forward


@ngt.graph_safe
class HostSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        scale = 2.0 if x.mean().item() > 0 else 1.0  # a host read: not capture-safe
        return self.lin(x) * scale


class WithHostSync(Regressor):
    def __init__(self):
        super().__init__()
        self.sync = HostSync()

    def forward(self, x):
        return self.head(self.sync(self.blocks[1](self.blocks[0](self.embed(x)))))


def test_on_failure_raise_stops_with_capture_error():
    torch.manual_seed(0)
    model = WithHostSync()
    train, val = loaders()
    expected = r"capturing sync failed.*_local_scalar_dense.*x\.mean\(\)\.item\(\)"
    graphs = NPUGraphCallback(warmup_steps=2)
    with pytest.raises(ngt.GraphCaptureError, match=expected):
        trainer([graphs]).fit(model, train, val)
    assert _graphed_forwards(model) == []
    status = {row["module"]: row["status"] for row in graphs.report()}
    assert status["sync"].startswith("capture failed: ") and "x.mean().item()" in status["sync"], status
    # captured with it into one pool, the blocks are not graphed either, and say why
    assert status["blocks.0"] == status["blocks.1"] == "not captured: capture of sync failed", status


class WithCausalEncoder(Regressor):
    """nn.TransformerEncoder given a causal mask, with is_causal left None: torch's own code checks the mask."""

    def __init__(self, is_causal=None):
        super().__init__(width=8, depth=0)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1,
                                             enable_nested_tensor=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(2))
        self.is_causal = is_causal

    def forward(self, x):
        h = self.encoder(x.view(-1, 2, 2).repeat(1, 1, 4), mask=self.mask, is_causal=self.is_causal)  # causal_call
        return self.head(h.mean(1))


def test_a_capture_error_names_the_users_call_of_the_module_and_the_fix():
    # The callback captures torch's module at the start of a step, outside the user's code: the stack holds only
    # trainer.fit, the recording step saw the line that called the module.
    train, val = loaders()
    with pytest.raises(ngt.GraphCaptureError) as caught:
        trainer([NPUGraphCallback(warmup_steps=2, modules=["encoder"])]).fit(WithCausalEncoder(), train, val)
    assert re.search(r"capturing encoder failed.*at .*test_callback\.py:\d+: .*# causal_call, in "
                     r"nn\.TransformerEncoder/.*is_causal=True where the mask is causal", str(caught.value))

    torch.manual_seed(0)
    eager = WithCausalEncoder(is_causal=True)
    trainer([]).fit(eager, train, val)
    torch.manual_seed(0)
    model = WithCausalEncoder(is_causal=True)  # the fix: graphed, and the same parameters as eager
    callback = NPUGraphCallback(warmup_steps=2, modules=["encoder"])
    trainer([callback]).fit(model, train, val)
    assert callback.report()[0]["replays"] > 0 and _same_params(eager, model)


def test_on_failure_eager_leaves_that_module_eager():
    torch.manual_seed(0)
    eager = WithHostSync()
    train, val = loaders()
    trainer([], max_steps=12).fit(eager, train, val)

    torch.manual_seed(0)
    model = WithHostSync()
    callback = NPUGraphCallback(warmup_steps=2, on_failure="eager")
    with pytest.warns(UserWarning, match="sync capture failed, runs eager"):
        trainer([callback], max_steps=12).fit(model, train, val)
    status = {row["module"]: row for row in callback.report()}
    assert status["blocks.0"]["status"] == "graphed" and status["blocks.0"]["replays"] == 9
    assert status["sync"]["status"].startswith("capture failed") and status["sync"]["replays"] == 0
    assert status["sync"]["eager_calls"] == {"capture failed": 10}  # steps 2-11 (validation not counted)
    assert _same_params(eager, model)


def test_eager_fallback_in_training_warns_once():
    callback = NPUGraphCallback(warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(callbacks=[callback], max_steps=20)
    fallbacks = [w for w in caught if "ran eager" in str(w.message)]
    assert len(fallbacks) == 1  # once for the modules graphed together, at the first short batch
    assert "float32[6, 8]" in str(fallbacks[0].message) and "graphed with it" in str(fallbacks[0].message)
    eager_calls = [row["eager_calls"] for row in callback.report()]
    assert len(eager_calls) == 2 and all(sum(calls.values()) > 0 for calls in eager_calls)  # each counts its own
    assert fallbacks[0].filename.endswith("lightning_models.py")  # the user's line that called the block


def test_modules_never_called_in_training_are_named_in_one_warning():
    class WithCopy(Regressor):  # an EMA-style copy of the blocks, never called in training_step
        def __init__(self):
            super().__init__(depth=3)
            self.ema_blocks = nn.ModuleList([Block(8) for _ in range(3)])

    callback = NPUGraphCallback(warmup_steps=2)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_steps=6).fit(WithCopy(), loaders()[0])
    uncalled = [str(w.message) for w in caught if "not called during the recording step" in str(w.message)]
    assert len(uncalled) == 1 and "ema_blocks.0, ema_blocks.1, ema_blocks.2 were not called" in uncalled[0]
    assert [r["replays"] for r in callback.report()] == [4, 4, 4, 0, 0, 0]


class TestModuleSelection:
    def test_patterns_add_unmarked_modules(self):
        callback = NPUGraphCallback(modules=["head"], warmup_steps=2)
        fit(callbacks=[callback], max_steps=6)
        assert [r["module"] for r in callback.report()] == ["blocks.0", "blocks.1", "head"]
        assert all(r["replays"] == 4 for r in callback.report())

    def test_modules_only_with_glob(self):
        callback = NPUGraphCallback(modules=["blocks.*.lin"], modules_only=True, warmup_steps=2)
        eager, _ = fit(max_steps=8)
        graphed, _ = fit(callbacks=[callback], max_steps=8)
        assert [r["module"] for r in callback.report()] == ["blocks.0.lin", "blocks.1.lin"]
        assert _same_params(eager, graphed)

    @pytest.mark.parametrize("pattern", ["blocks", "*"])
    def test_containers_stand_for_their_children(self, pattern):
        # `blocks` is a ModuleList (never called itself); "*" also matches embed and head
        callback = NPUGraphCallback(modules=[pattern], modules_only=True, warmup_steps=2)
        fit(callbacks=[callback], max_steps=6)
        expected = ["blocks.0", "blocks.1"] if pattern == "blocks" else ["embed", "blocks.0", "blocks.1", "head"]
        assert [r["module"] for r in callback.report()] == expected
        assert all(r["status"] == "graphed" and r["replays"] == 4 for r in callback.report())

    def test_pattern_matching_nothing_is_an_error(self):
        with pytest.raises(MisconfigurationException, match=r"'decoder\.\*' matches no submodule.*embed"):
            fit(callbacks=[NPUGraphCallback(modules=["decoder.*"])], max_steps=2)

    def test_no_modules_warns(self):
        class Unmarked(Regressor):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        with pytest.warns(UserWarning, match="no @graph_safe submodules and no `modules` patterns"):
            trainer([NPUGraphCallback()], max_steps=2).fit(Unmarked(), *loaders())

    def test_modules_only_without_patterns_is_refused(self):
        # it warned "no @graph_safe submodules" although the model has marked blocks
        with pytest.raises(MisconfigurationException, match=r"modules_only=True graphs only the submodules listed in "
                                                            r"`modules`, and modules is empty; list them"):
            NPUGraphCallback(modules_only=True)


def test_whole_step_warns_about_the_submodule_settings_it_ignores():
    callback = NPUGraphCallback(mode="whole_step", modules=["head"], modules_only=True, num_warmup_iters=5)
    with pytest.warns(UserWarning) as caught:
        callback.setup(trainer([callback]), Regressor(), "fit")
    ignored = [str(w.message) for w in caught if "ignores them" in str(w.message)]
    assert ignored == ["NPUGraphCallback(mode='whole_step'): modules=['head'], modules_only=True, num_warmup_iters=5 "
                       "choose and capture submodules in mode='submodules'; whole-step mode captures the whole "
                       "training step and ignores them"]
    callback = NPUGraphCallback(mode="whole_step")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.setup(trainer([callback]), Regressor(), "fit")
    assert not [w for w in caught if "ignores them" in str(w.message)]


def test_mode_off_warns_and_trains_eager():
    eager, _ = fit(max_steps=6)
    with pytest.warns(UserWarning, match="graph capture is off"):
        graphed, _ = fit(callbacks=[NPUGraphCallback(mode="off")], max_steps=6)
    assert _same_params(eager, graphed)


def test_graphs_for_another_device_than_the_trainers_are_refused_and_auto_follows_the_trainer(
        cuda_double, monkeypatch):
    with pytest.raises(ngt.BackendUnavailableError, match=r"graph backend 'cuda' \(from NPUGRAPH_BACKEND=cuda\) "
                                                           r"captures cuda tensors, but training runs on cpu: use "
                                                           r"backend 'auto' or 'emulate'"):
        fit(callbacks=[NPUGraphCallback()], max_steps=2)
    monkeypatch.delenv("NPUGRAPH_BACKEND")  # auto: the CUDA double is usable, but the Trainer is on the CPU
    callback = NPUGraphCallback(log_report=False)
    fit(callbacks=[callback], max_steps=6)
    assert "emulate" in callback.format_report() and callback.report()[0]["replays"] > 0


@pytest.mark.parametrize("env, message", [
    ("cuda", "graph backend 'cuda' (from NPUGRAPH_BACKEND=cuda) is not available"),
    ("bogus", "unknown graph backend 'bogus' (from NPUGRAPH_BACKEND=bogus)"),
])
def test_a_backend_from_the_environment_is_blamed_on_it(monkeypatch, env, message):
    # the callback's backend='auto' defers to NPUGRAPH_BACKEND; the error said "(from argument)"
    monkeypatch.setenv("NPUGRAPH_BACKEND", env)
    with pytest.raises(ngt.BackendUnavailableError) as info:
        fit(callbacks=[NPUGraphCallback()], max_steps=2)
    assert message in str(info.value) and "set NPUGRAPH_BACKEND to one of them, or unset it" in str(info.value)


class TestConfig:
    @pytest.mark.parametrize("kwargs, message", [
        ({"mode": "full"}, "mode='full' is not valid; choose one of: off, submodules, whole_step"),
        ({"backend": "tpu"}, "backend='tpu' is not valid; choose one of: auto, npu, cuda, emulate"),
        ({"on_failure": "skip"}, "on_failure='skip' is not valid; choose one of: raise, eager"),
        ({"capture_error_mode": "strict"}, "choose one of: global, thread_local, relaxed"),
        ({"warmup_steps": 0}, "warmup_steps=0 is not valid; expected an integer >= 1"),
        ({"max_signatures": 2.5}, "max_signatures=2.5 is not valid"),
        ({"modules": "blocks.*"}, "modules='blocks.*' is a string, not a list; write modules=['blocks.*'] (in a "
                                  "Hydra override, quote the list: graph.modules='[blocks.*]')"),
        ({"modules": ["head", None]}, "modules[1]=None is not valid; expected a submodule name or glob pattern"),
        ({"modules": [1]}, "modules[0]=1 is not valid"),
    ])
    def test_bad_values(self, kwargs, message):
        with pytest.raises(MisconfigurationException, match=re.escape(message)):
            NPUGraphCallback(**kwargs)

    def test_from_config_rejects_unknown_keys_and_types(self):
        with pytest.raises(MisconfigurationException, match="unknown settings 'warmup_step' \\(did you mean "
                                                            "'warmup_steps'\\?\\); valid settings: mode, warmup_steps"):
            NPUGraphCallback.from_config({"warmup_step": 3})
        with pytest.raises(MisconfigurationException, match="at 'warmup_steps' \\(expected int\\)"):
            NPUGraphCallback.from_config(OmegaConf.create({"warmup_steps": "three"}))
        with pytest.raises(MisconfigurationException, match="modules='blocks.\\*' is a string, not a list"):
            NPUGraphCallback.from_config({"modules": "blocks.*"})
        with pytest.raises(MisconfigurationException, match=re.escape("NPUGraphConfig.modules={'blocks': 1} is not "
                                                                      "valid; expected a list")):
            NPUGraphCallback.from_config(OmegaConf.create({"modules": {"blocks": 1}}))
        assert NPUGraphCallback.from_config({"modules": None}).config.modules == []  # as the constructor and Hydra
        # OmegaConf's conversion, as for other settings: an index on a Hydra command line (modules=[0]) is a name
        assert NPUGraphCallback.from_config(OmegaConf.create({"modules": [0, "head"]})).config.modules == ["0", "head"]

    @pytest.mark.parametrize("cfg, message", [
        (OmegaConf.create({"mode": "???"}), "mode is '???' (a required value that was never given); set mode (choose "
                                            "one of: off, submodules, whole_step)"),
        ({"warmup_steps": "???"}, "warmup_steps is '???'"),
        (OmegaConf.create({"graph": {"warmup_steps": "${nope}"}}).graph,
         "the value of warmup_steps cannot be resolved (Interpolation key 'nope' not found); fix the interpolation "
         "or set warmup_steps directly (expected an integer >= 1)"),
        (OmegaConf.create({"bogus": "???"}), "unknown settings 'bogus'"),
    ])
    def test_missing_and_unresolvable_values_name_the_setting(self, cfg, message):
        # '???' became the default; a bad interpolation raised OmegaConf's own error
        with pytest.raises(MisconfigurationException, match=re.escape(message)):
            NPUGraphCallback.from_config(cfg)

    def test_from_config_input_shapes(self):
        for cfg in ("mode=off", ["mode"], OmegaConf.create(["mode"])):
            with pytest.raises(MisconfigurationException, match="config must be a mapping of settings"):
                NPUGraphCallback.from_config(cfg)
        for cfg in (None, NPUGraphConfig()):  # a typo in the overrides has the "did you mean" of the mapping path
            with pytest.raises(MisconfigurationException, match=r"unknown settings 'warmpu_steps' \(did you mean "
                                                                r"'warmup_steps'\?\)"):
                NPUGraphConfig.create(cfg, warmpu_steps=7)
        node = {"_target_": "npugraph_train.NPUGraphCallback", "_partial_": False, "_recursive_": False,
                "_convert_": "all", "mode": "off"}
        assert NPUGraphCallback.from_config(node).config.mode == "off"
        overridden = NPUGraphCallback.from_config(node, warmup_steps=7, mode="whole_step").config
        assert (overridden.mode, overridden.warmup_steps) == ("whole_step", 7)
        with pytest.raises(MisconfigurationException, match=r"unknown settings 'warmpu_steps'"):
            NPUGraphCallback.from_config(node, warmpu_steps=7)

    def test_hydra_target_with_a_typo_names_the_valid_settings(self):
        from hydra.utils import instantiate

        node = OmegaConf.create({"_target_": "npugraph_train.NPUGraphCallback", "mdoe": "whole_step"})
        with pytest.raises(Exception, match="unknown settings 'mdoe' \\(did you mean 'mode'\\?\\); valid settings: "
                                            "mode, warmup_steps"):
            instantiate(node)

    def test_signature_takes_every_setting_with_the_configs_default(self):
        # LightningCLI and Hydra read the callback's signature; the config is what the callback uses.
        params = inspect.signature(NPUGraphCallback).parameters
        for f in dataclasses.fields(NPUGraphConfig):
            assert f.name in params, f"NPUGraphCallback does not take {f.name}"
            default = params[f.name].default
            assert getattr(NPUGraphCallback(**{f.name: default}).config, f.name) == getattr(NPUGraphConfig(), f.name)

    def test_from_config_dataclass_dict_and_dictconfig(self):
        structured = OmegaConf.structured(NPUGraphConfig(modules=["blocks.*"], max_signatures=2))
        for cfg in (NPUGraphConfig(modules=["blocks.*"], max_signatures=2), structured,
                    {"modules": ["blocks.*"], "max_signatures": 2}):
            callback = NPUGraphCallback.from_config(cfg)
            assert callback.config.modules == ["blocks.*"] and callback.config.max_signatures == 2

    def test_hydra_instantiate(self):
        from hydra.utils import instantiate

        node = OmegaConf.create({"_target_": "npugraph_train.NPUGraphCallback", "modules": ["head"],
                                 "warmup_steps": 2, "on_failure": "eager"})
        callback = instantiate(node)
        assert isinstance(callback, NPUGraphCallback)
        assert callback.config.modules == ["head"] and type(callback.config.modules) is list
        assert NPUGraphCallback.from_config(node).config.on_failure == "eager"
        fit(callbacks=[callback], max_steps=4)
        assert [r["module"] for r in callback.report()] == ["blocks.0", "blocks.1", "head"]



def test_two_callbacks_are_refused():
    # they failed later with unrelated errors (a nested replay; "is already graphed")
    a, b = NPUGraphCallback(), NPUGraphCallback(mode="whole_step")
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `NPUGraphCallback`"):
        trainer([a, b])  # Lightning's check: one state_key
    t = trainer([a])
    t.callbacks.append(b)
    with pytest.raises(MisconfigurationException, match=r"the Trainer has 2 NPUGraphCallbacks \(NPUGraphCallback\("
                                                        r"mode='submodules'\), NPUGraphCallback\(mode='whole_step'\)"
                                                        r"\), which would graph the same model twice; use one"):
        t.fit(Regressor(), *loaders())


def test_checkpoints_resume_in_another_mode_and_from_the_settings_keyed_state(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    t = trainer([NPUGraphCallback(warmup_steps=2)], max_steps=6)
    t.fit(model, *loaders())
    t.save_checkpoint(tmp_path / "a.ckpt")
    assert list(torch.load(tmp_path / "a.ckpt", weights_only=False)["callbacks"]) == ["NPUGraphCallback"]

    resumed = NPUGraphCallback(mode="whole_step", warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([resumed], max_steps=10).fit(Regressor(), *loaders(), ckpt_path=tmp_path / "a.ckpt")
    assert not [w for w in caught if "Please add the following callbacks" in str(w.message)]
    assert resumed.state_dict() == {"fits_captured": 2}

    # Checkpoints of earlier versions keyed the state by the settings (Lightning warns that it lacks that key, and
    # the callback finds its state under it all the same).
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    checkpoint["callbacks"] = {"NPUGraphCallback{'mode': 'submodules', 'modules': []}": {"fits_captured": 5}}
    torch.save(checkpoint, tmp_path / "old.ckpt")
    resumed = NPUGraphCallback(warmup_steps=2)
    with pytest.warns(UserWarning, match="Please add the following callbacks"):
        trainer([resumed], max_steps=10).fit(Regressor(), *loaders(), ckpt_path=tmp_path / "old.ckpt")
    assert resumed.state_dict() == {"fits_captured": 6}


def test_capture_waits_when_the_recorded_batch_is_short():
    # 9 batches per epoch, the 9th short: warmup_steps=9 records step 8's short batch. Step 9 is full, so it
    # records again and step 10 captures the full shape; the short batches (steps 17, 26, 35) run eager.
    eager, _ = fit()
    callback = NPUGraphCallback(warmup_steps=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed, t = fit(callbacks=[callback])
    assert _same_params(eager, graphed)
    waits = [w for w in caught if "capture waits" in str(w.message)]
    assert len(waits) == 1 and "float32[6, 4]" in str(waits[0].message)
    for row in callback.report():
        assert [s["description"] for s in row["signatures"]] == ["(float32[8, 8]*)"]  # *: requires grad
        assert row["replays"] == 36 - 10 - 3
        assert sum(n for r, n in row["eager_calls"].items() if "6, 8" in r) == 3


class _TwoBatchesPerEpoch(Regressor):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx >= 2 else None  # Lightning skips the rest of the epoch


def test_a_skipped_recording_step_records_again():
    # Two steps per epoch. warmup_steps=3 records at the third batch of epoch 1, which Lightning skips: its hooks
    # must not stay on, and the next step (epoch 2's first) records again; step 3 captures. warmup_steps=4
    # captures at a batch that is then skipped: the graphs replay from the next step on.
    torch.manual_seed(0)
    eager = _TwoBatchesPerEpoch()
    trainer([], max_steps=-1, max_epochs=5).fit(eager, *loaders())
    for warmup_steps in (3, 4):
        callback = NPUGraphCallback(warmup_steps=warmup_steps)
        torch.manual_seed(0)
        graphed = _TwoBatchesPerEpoch()
        t = trainer([callback], max_steps=-1, max_epochs=5)
        t.fit(graphed, *loaders())
        assert t.global_step == 10 and _same_params(eager, graphed)
        assert [row["replays"] for row in callback.report()] == [10 - warmup_steps] * 2


def test_detect_anomaly_is_refused_at_fit_start():
    with pytest.raises(MisconfigurationException, match=r"mode='submodules'\) cannot capture with Trainer\(detect_an"):
        fit(callbacks=[NPUGraphCallback()], detect_anomaly=True, max_steps=2)


@pytest.mark.parametrize("mode", ["submodules", "whole_step"])
def test_fit_ending_before_capture_warns(mode):
    callback = NPUGraphCallback(mode=mode, warmup_steps=5)
    with pytest.warns(UserWarning, match=r"fit ended after 3 training steps, before capture \(warmup_steps=5\)"):
        fit(callbacks=[callback], max_steps=3)
    assert {row["status"] for row in callback.report()} == {"not captured: fit ended before capture"}


def test_report_puts_capture_errors_on_their_own_line_and_explains_the_star():
    from npugraph_train.callbacks.report import format_report

    rows = [{"module": "blocks.0", "status": "capture failed, runs eager: op aten.item reads tensor data on the host",
             "signatures": [], "replays": 0, "eager_calls": {"capture failed": 3}},
            {"module": "blocks.1", "status": "graphed", "replays": 4, "eager_calls": {},
             "signatures": [{"description": "(float32[8, 8]*)", "replays": 4, "capture_seconds": 0.01,
                             "pool_bytes": None}]}]
    lines = format_report(rows, mode="submodules", backend="emulate").splitlines()
    assert lines[1:3] == ["  blocks.0: replays 0, eager calls 3",
                          "    status: capture failed, runs eager: op aten.item reads tensor data on the host"]
    assert lines[4] == "  blocks.1: graphed; replays 4, eager calls 0"
    assert lines[-1] == "  (* after a shape: that input requires grad)"


def test_non_tensor_batch_values_do_not_delay_submodule_capture():
    import numpy as np
    from torch.utils.data import DataLoader

    class WithMeta(Regressor):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch[:2], batch_idx)

    train, val = loaders()
    collate = lambda items: (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]),  # noqa: E731
                             np.arange(len(items)) + len(items), [f"id{i}" for i in range(len(items))])
    torch.manual_seed(0)
    callback = NPUGraphCallback(warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_steps=6).fit(WithMeta(), DataLoader(train.dataset, batch_size=8, collate_fn=collate),
                                            val)
    assert not [w for w in caught if "capture waits" in str(w.message)]
    assert all(r["replays"] == 4 for r in callback.report())  # captured on step 2, as without the extras


def test_containers_with_shared_modules():
    model = Regressor()
    model.first = model.blocks[0]  # registered under two names; named_modules() keeps the first
    from npugraph_train.callbacks.submodules import select_modules

    chosen = select_modules(model, NPUGraphConfig(modules=["blocks"], modules_only=True))
    assert [name for name, _ in chosen] == ["blocks.0", "blocks.1"]


class StopGradientTarget(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():  # a target from the same blocks (BYOL/SimSiam style), called first
            target = self(x + 0.1)
        pred = self(x)
        return nn.functional.mse_loss(pred, target) + nn.functional.mse_loss(pred, y)


def _fit_new(model_class, callbacks, max_steps=12):
    torch.manual_seed(0)
    model = model_class()
    trainer(callbacks, max_steps=max_steps).fit(model, *loaders())
    return model


class FrozenTarget(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.requires_grad_(False)  # as toggle_optimizer leaves a GAN's other model: grad mode, nothing trains
        target = self(x + 0.1)
        self.requires_grad_(True)
        pred = self(x)
        return nn.functional.mse_loss(pred, target) + nn.functional.mse_loss(pred, y)


@pytest.mark.parametrize("model_class", [StopGradientTarget, FrozenTarget])
def test_the_training_call_is_captured_not_an_earlier_one_that_trains_nothing(model_class):
    callback = NPUGraphCallback(warmup_steps=2)
    eager, graphed = _fit_new(model_class, []), _fit_new(model_class, [callback])
    assert _same_params(eager, graphed)
    row = callback.report()[0]
    assert row["signatures"][0]["description"] == "(float32[8, 8]*)", "the input of the call that trains"
    # 12 steps: 2 warmup, one short batch; the call that trains nothing replays the same graphs
    assert row["replays"] == 2 * 9 and sum(row["eager_calls"].values()) == 2 + 2  # validation, short batch


@ngt.graph_safe
class SelfAttention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)

    def forward(self, q, k, v):
        return self.attn(q, k, v, need_weights=False)[0]


class Attends(Regressor):
    def __init__(self):
        super().__init__()
        self.mix = SelfAttention(8)

    def forward(self, x):
        h = self.embed(x).unsqueeze(1).expand(-1, 3, -1)
        return self.head(self.mix(h, h, h).mean(1))


def test_self_attention_called_with_one_tensor_three_times():
    callback = NPUGraphCallback(warmup_steps=2, modules_only=True, modules=["mix"])
    eager, graphed = _fit_new(Attends, []), _fit_new(Attends, [callback])
    assert _same_params(eager, graphed)
    assert callback.report()[0]["replays"] == 9  # 12 steps: 2 warmup, one short batch


class BuiltInConfigureModel(Regressor):
    """Blocks made in configure_model (Lightning's place for large models), after callbacks' setup ran."""

    def __init__(self):
        super().__init__(depth=0)

    def configure_model(self):
        if not len(self.blocks):
            torch.manual_seed(7)
            self.blocks.extend(Block(8) for _ in range(2))


@pytest.mark.parametrize("modules", [[], ["blocks.*"]])
def test_blocks_built_in_configure_model_are_graphed(modules):
    callback = NPUGraphCallback(warmup_steps=2, modules=modules)
    eager, graphed = _fit_new(BuiltInConfigureModel, []), _fit_new(BuiltInConfigureModel, [callback])
    assert _same_params(eager, graphed)
    assert [(row["module"], row["replays"]) for row in callback.report()] == [("blocks.0", 9), ("blocks.1", 9)]


class Attend(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.q = nn.Linear(width, width)

    def forward(self, latents, h):
        return (self.q(latents) @ h.transpose(-1, -2)).softmax(-1) @ h  # a 2-D by 3-D matmul


class Distills(Regressor):
    """A student and a frozen teacher (its moving average) of one module, the teacher called under no_grad."""

    def __init__(self):
        super().__init__(width=16)
        self.latents, self.positions = nn.Parameter(torch.randn(4, 16)), nn.Parameter(torch.randn(6, 16))
        self.student = Attend(16)
        self.teacher = Attend(16).requires_grad_(False)
        self.teacher.load_state_dict(self.student.state_dict())

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)[:, None, :] + self.positions  # (batch, 6, 16)
        out = self.student(self.latents, h)
        with torch.no_grad():
            target = self.teacher(self.latents, h.detach())
        return nn.functional.mse_loss(out.mean((1, 2)), y[:, 0]) + nn.functional.mse_loss(out, target)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.lerp_(s, 0.1)


def test_a_teacher_called_under_no_grad_matches_eager_bitwise():
    # Its calls need no gradient, so it is captured as eager runs it under no_grad: matmul of a 2-D input that
    # requires grad by a 3-D one takes another path in grad mode than under no_grad, with other bits.
    def run(callbacks):
        torch.manual_seed(0)
        model = Distills()
        trainer(callbacks, max_steps=12, limit_val_batches=0).fit(model, loaders()[0])
        return model

    graphs = NPUGraphCallback(modules=["student", "teacher"], modules_only=True, warmup_steps=2)
    eager, graphed = run([]), run([graphs])
    assert all(row["replays"] >= 8 for row in graphs.report()), graphs.report()
    assert _same_params(eager, graphed)


class StochasticDepth(Regressor):
    """Skips its first block at random, the choice drawn with Python's random inside the block's forward."""

    def __init__(self):
        super().__init__()
        block = self.blocks[0]
        forward = block.forward
        block.forward = lambda x: forward(x) if random.random() < 0.7 else x


def test_a_graph_safe_block_drawing_on_the_host_runs_eager_like_plain_lightning():
    def run(callbacks):
        random.seed(0)
        torch.manual_seed(0)
        model = StochasticDepth()
        trainer(callbacks, max_steps=12).fit(model, *loaders())
        return model, random.random()

    eager, eager_next = run([])
    callback = NPUGraphCallback(warmup_steps=2, on_failure="eager")
    with pytest.warns(UserWarning, match="blocks.0 capture failed, runs eager: .*draws random numbers from "
                                         "Python's random on the host"):
        graphed, graphed_next = run([callback])
    assert _same_params(eager, graphed) and graphed_next == eager_next
    rows = {row["module"]: row for row in callback.report()}
    assert rows["blocks.0"]["status"].startswith("capture failed") and rows["blocks.1"]["replays"] == 9


class Scaled(Regressor):
    """Its first block scales its output by a tensor kept in a plain attribute (not a buffer)."""

    def __init__(self):
        super().__init__()
        block = self.blocks[0]
        block.scale = torch.tensor(1.0)
        block.forward = lambda x: x + torch.tanh(block.norm(block.lin(x))) * block.scale


def test_a_tensor_attribute_of_a_graphed_block_rebound_captures_again():
    class Rebinds(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 5:
                pl_module.blocks[0].scale = torch.tensor(0.2)

    def run(callbacks):
        torch.manual_seed(0)
        model = Scaled()
        trainer([Rebinds()] + callbacks, max_steps=8).fit(model, *loaders())
        return model

    eager = run([])
    callback = NPUGraphCallback(warmup_steps=2)
    with pytest.warns(RuntimeWarning, match=r"blocks.0: the tensor in its attribute scale was replaced \(scale = "):
        graphed = run([callback])
    assert _same_params(eager, graphed)
    assert callback.report()[0]["signatures"][0]["captures"] == 2


class OwnAutocast(Regressor):
    """Runs its blocks under an autocast state of its own: bf16 in a float32 fit, or none in a bf16-mixed one."""

    def forward(self, x):
        h = self.embed(x).float()
        enabled = self.trainer.precision == "32-true"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled, cache_enabled=False):
            for block in self.blocks:
                h = block(h)
        return self.head(h.float())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_blocks_are_captured_in_the_autocast_state_they_are_called_in(precision):
    def run(callbacks):
        torch.manual_seed(0)
        model = OwnAutocast()
        trainer(callbacks, max_steps=12, precision=precision).fit(model, *loaders())
        return model

    eager = run([])
    callback = NPUGraphCallback(warmup_steps=2)
    graphed = run([callback])
    assert _same_params(eager, graphed)
    assert all(row["replays"] == 9 for row in callback.report()), callback.report()  # one short batch


def test_a_failed_capture_under_bf16_mixed_leaves_the_other_blocks_graphed():
    # The precision plugin's forward context is entered again for the capture that follows a failed one.
    class ReadsHost(Regressor):
        def __init__(self):
            super().__init__()
            block = self.blocks[1]
            block.forward = lambda x: x * float(x.abs().max() > 0)

    def run(callbacks):
        torch.manual_seed(0)
        model = ReadsHost()
        trainer(callbacks, max_steps=8, precision="bf16-mixed").fit(model, *loaders())
        return model

    eager = run([])
    callback = NPUGraphCallback(warmup_steps=2, on_failure="eager")
    with pytest.warns(UserWarning, match="blocks.1 capture failed, runs eager"):
        graphed = run([callback])
    rows = {row["module"]: row for row in callback.report()}
    assert rows["blocks.0"]["replays"] == 6 and rows["blocks.1"]["status"].startswith("capture failed")
    assert _same_params(eager, graphed)


class FreezesBlock(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 6:
            pl_module.blocks[0].eval()  # a frozen part, after the blocks were captured in train mode


def test_a_graphed_module_put_in_eval_during_training_runs_eager_with_a_warning():
    eager, _ = fit({"dropout": 0.1}, [FreezesBlock()], max_steps=12, val_check_interval=None, limit_val_batches=0)
    callback = NPUGraphCallback()
    with pytest.warns(UserWarning, match=r"blocks.0 is in eval mode in training steps, and its graphs were captured in "
                                         r"train mode, so its calls run eager.*in on_train_epoch_start"):
        graphed, _ = fit({"dropout": 0.1}, [FreezesBlock(), callback], max_steps=12, val_check_interval=None,
                         limit_val_batches=0)
    assert _same_params(eager, graphed)
    rows = {row["module"]: row for row in callback.report()}
    assert [n for r, n in rows["blocks.0"]["eager_calls"].items() if "mode differs" in r] == [6]
    assert not any("mode differs" in r for r in rows["blocks.1"]["eager_calls"])


def test_config_keys_that_look_like_hydras_and_an_unquoted_yaml_off_are_named():
    with pytest.raises(MisconfigurationException, match=r"mode='False' is not valid.*YAML reads an unquoted off as "
                                                        r"false: write mode: 'off'"):
        NPUGraphCallback.from_config(OmegaConf.create("mode: off"))
    with pytest.raises(MisconfigurationException, match="unknown settings '_targt_'"):
        NPUGraphCallback.from_config({"_targt_": "npugraph_train.NPUGraphCallback", "mode": "off"})
    assert NPUGraphCallback.from_config({"_target_": "npugraph_train.NPUGraphCallback", "_partial_": True,
                                         "mode": "off"}).config.mode == "off"
