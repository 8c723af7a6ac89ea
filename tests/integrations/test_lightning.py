"""CastwiseCallback under a real lightning.Trainer: story 3 (bf16-mixed, validation crashes)."""

from __future__ import annotations

import logging
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import castwise
from castwise.errors import CastwiseError
from castwise.lightning import CastwiseAuditError, CastwiseCallback
from castwise.stories import PoseAutoEncoder


class PoseModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = PoseAutoEncoder()
        self.train_steps = 0
        self.val_steps = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x, mask)
        return out

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = batch
        return torch.nn.functional.mse_loss(self(x, mask).float(), x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_steps += 1
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_steps += 1
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    x = torch.randn(8, 10, 24)
    mask = torch.zeros(8, 10, dtype=torch.bool)
    mask[1::2, 7:] = True
    return DataLoader(TensorDataset(x, mask), batch_size=4)


def _trainer(callback: CastwiseCallback) -> pl.Trainer:
    return pl.Trainer(
        precision="bf16-mixed",
        accelerator="cpu",
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=2,
        limit_val_batches=1,
    )


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)


def test_story3_fails_for_real_in_validation_without_castwise() -> None:
    module = PoseModule()
    trainer = pl.Trainer(
        precision="bf16-mixed",
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=2,
        limit_val_batches=1,
    )
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        trainer.fit(module, _loader(), _loader())
    assert module.train_steps == 2  # training worked; validation crashed


def test_callback_stops_before_the_first_training_step() -> None:
    module = PoseModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CastwiseAuditError) as info:
        _trainer(CastwiseCallback()).fit(module, _loader(), _loader())
    assert module.train_steps == 0 and module.val_steps == 0
    message = str(info.value)
    assert "model.encoder.layers.0" in message
    assert "fastpath=off" in message  # the fix
    assert info.value.report.errors[0].module == "model.encoder.layers.0"
    # the audit left the module as it was
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_callback_fix_applies_the_policy_and_the_fit_completes() -> None:
    module = PoseModule()
    callback = CastwiseCallback(fix=True)
    fastpath_before = torch.backends.mha.get_fastpath_enabled()
    _trainer(callback).fit(module, _loader(), _loader())
    assert module.train_steps == 2 and module.val_steps == 1  # validation included
    assert callback.applied is not None and not callback.applied.policy.fastpath
    assert str(callback.applied.policy) == "bf16-mixed,fastpath=off"
    assert torch.backends.mha.get_fastpath_enabled() == fastpath_before  # restored after the fit


def test_clean_model_passes_through() -> None:
    module = PoseModule()
    callback = CastwiseCallback()
    trainer = pl.Trainer(
        precision="32-true",
        accelerator="cpu",
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=1,
        limit_val_batches=1,
    )
    trainer.fit(module, _loader(), _loader())
    assert callback.report is not None and callback.report.ok
    assert module.train_steps == 1 and callback.applied is None


class UpcastNorm(pl.LightningModule):
    """Normalises in float32 by hand with the norm's own weight: fine in float32, fails once
    Lightning's bf16-true has converted that weight (Lightning converts norms too)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        h = self.proj(batch[0])
        h = torch.nn.functional.layer_norm(h.float(), (8,), self.norm.weight, self.norm.bias)
        return h.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_callback_audits_lightnings_own_meaning_of_bf16_true() -> None:
    data = DataLoader(TensorDataset(torch.randn(4, 8)), batch_size=2)

    def trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            precision="bf16-true",
            accelerator="cpu",
            max_steps=1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    with pytest.raises(RuntimeError, match="dtype"):  # the real failure, without castwise
        trainer([]).fit(UpcastNorm(), data)
    with pytest.raises(CastwiseAuditError, match=r"norm|layer_norm") as info:
        trainer([CastwiseCallback()]).fit(UpcastNorm(), data)
    # the module's own code raised: named as the top level, not as an empty name
    assert "CW109 at the model's top level" in str(info.value) and "``" not in str(info.value)


def test_the_audit_does_not_trigger_lightnings_log_warning() -> None:
    """PoseModule calls self.log in both steps; the audit's copy must not warn that it has no
    trainer (the user would see a Lightning warning about their own, correct, code)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(CastwiseAuditError):
            _trainer(CastwiseCallback()).fit(PoseModule(), _loader(), _loader())
    texts = [str(w.message) for w in seen]
    assert not [t for t in texts if "self.log()" in t], texts


def test_findings_name_modules_as_the_lightning_module_does() -> None:
    with pytest.raises(CastwiseAuditError) as info:
        _trainer(CastwiseCallback()).fit(PoseModule(), _loader(), _loader())
    report = info.value.report
    # everywhere: the stop message, each finding's message and details, the rendered report, JSON
    for text in (str(info.value), str(report), report.to_json()):
        assert "module.model" not in text and "`module`" not in text
    cw103 = next(f for f in report.findings if f.code == "CW103")
    assert cw103.module == "model.encoder.layers.0" and "`model.encoder.layers.1`" in cw103.message
    assert dict(cw103.details)["culprit_modules"] == ["model.proj"]
    assert cw103.origin is not None and cw103.origin.module == "model.proj"


class IndexBug(pl.LightningModule):
    """A plain bug, not a dtype error: the batch is a 1-tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.proj(batch[0]).sum()
        return loss + batch[1].sum()  # the user's line

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _index_bug_fit(callbacks: list[pl.Callback]) -> BaseException:
    data = DataLoader(TensorDataset(torch.randn(4, 8)), batch_size=2)
    trainer = pl.Trainer(
        precision="bf16-mixed",
        accelerator="cpu",
        max_steps=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(BaseException) as info:
        trainer.fit(IndexBug(), data)
    return info.value


@pytest.mark.parametrize("fix", [False, True])
def test_an_error_that_is_not_about_dtypes_reaches_the_caller_untouched(
    fix: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="castwise")
    plain = _index_bug_fit([])
    got = _index_bug_fit([CastwiseCallback(fix=fix)])
    assert type(got) is type(plain) is IndexError and str(got) == str(plain)
    innermost = traceback.extract_tb(got.__traceback__)[-1]
    assert innermost.name == "training_step" and "loss + batch[1].sum()  # the user's line" in str(innermost.line)
    plain_innermost = traceback.extract_tb(plain.__traceback__)[-1]
    assert (innermost.filename, innermost.lineno) == (plain_innermost.filename, plain_innermost.lineno)
    package = str(Path(castwise.__file__).parent)
    assert not [f for f in traceback.extract_tb(got.__traceback__) if f.filename.startswith(package)]
    assert got.__cause__ is None and not isinstance(got.__context__, CastwiseError)
    assert all(n.startswith("castwise") for n in getattr(got, "__notes__", []))
    lines = [r for r in caplog.records if r.name == "castwise"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "IndexError" in lines[0].getMessage() and "not a dtype problem" in lines[0].getMessage()


def test_fix_says_in_one_log_line_which_policy_it_applied(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="castwise")
    _trainer(CastwiseCallback(fix=True)).fit(PoseModule(), _loader(), _loader())
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert lines == [
        "castwise: applied suggested policy bf16-mixed,fastpath=off (fixes CW103 at model.encoder.layers.0)"
    ]


def test_a_clean_pass_says_so_in_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="castwise")
    trainer = pl.Trainer(
        precision="32-true",
        accelerator="cpu",
        max_steps=1,
        callbacks=[CastwiseCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    trainer.fit(PoseModule(), _loader(), _loader())
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert lines == ["castwise: audited training_step and validation_step under 32-true: no dtype errors"]


def test_parameters_are_keyword_only_and_the_mode_is_checked() -> None:
    with pytest.raises(TypeError):
        CastwiseCallback(True)  # type: ignore[misc]
    with pytest.raises(CastwiseError, match="valid modes: both, eval, train"):
        CastwiseCallback(mode="validation")


def test_a_module_with_the_policy_applied_audits_clean(caplog: pytest.LogCaptureFixture) -> None:
    """After fix=True (or castwise.apply) the module keeps the policy as an instance forward: the
    next fit's audit must run the step, and the step's self(...) that policy's forward."""
    module = PoseModule()
    castwise.apply(module, "bf16-mixed,fastpath=off")  # what CastwiseCallback(fix=True) leaves on it
    caplog.set_level(logging.INFO, logger="castwise")
    callback = CastwiseCallback()
    _trainer(callback).fit(module, _loader(), _loader())
    assert callback.report is not None and callback.report.ok, callback.report
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert lines == ["castwise: audited training_step and validation_step under bf16-mixed: no dtype errors"]
    assert module.train_steps == 2 and module.val_steps == 1


class Uncopyable(PoseModule):
    """A module holding a lock (as some data-loading helpers do): castwise cannot copy it."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lock = threading.Lock()


def test_a_module_castwise_cannot_audit_trains_as_without_the_callback(caplog: pytest.LogCaptureFixture) -> None:
    """castwise's own limit (here: the module cannot be copied, an AuditError) is one warning,
    and the fit goes on as it would without the callback: it never stops a user's run."""
    caplog.set_level(logging.INFO, logger="castwise")

    def fit(callbacks: list[pl.Callback]) -> Uncopyable:
        torch.manual_seed(0)
        module = Uncopyable()  # trained only (story 3 fails in validation)
        trainer = _trainer(callbacks[0]) if callbacks else _trainer(CastwiseCallback())
        if not callbacks:
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, CastwiseCallback)]
        trainer.fit(module, _loader())
        return module

    plain = fit([])
    watched = fit([CastwiseCallback()])
    assert watched.train_steps == plain.train_steps == 2
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert len(lines) == 1 and "Uncopyable (CastwiseCallback) not audited, the run goes on: cannot copy" in lines[0]
