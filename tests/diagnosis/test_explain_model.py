"""The fitted explain model: its file, its corpus, what it answers and how it says it is unsure."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from castwise.categories import CATEGORIES
from castwise.diagnosis._model import load
from castwise.diagnosis.explain import explain, read_evidence

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "benchmarks" / "data" / "explain" / "reports.jsonl"


def _reports() -> list[dict[str, object]]:
    return [json.loads(line) for line in REPORTS.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_corpus_is_real_reports_with_a_frozen_split() -> None:
    rows = _reports()
    assert len(rows) >= 250
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["project"] for r in rows}) >= 40
    for r in rows:
        assert set(r) >= {"id", "url", "project", "date", "text", "diagnosis", "category", "split", "kind", "device"}
        assert str(r["url"]).startswith("https://"), r["id"]
        assert r["category"] in CATEGORIES, r["id"]
        assert r["kind"] in ("exception", "silent") and r["device"] in ("cpu", "cuda", "mps", "unknown")
        # the split is a function of the id, assigned before any fit and never changed
        h = int(hashlib.sha256(str(r["id"]).encode()).hexdigest()[:8], 16) / 2**32
        assert r["split"] == ("test" if h < 0.35 else "train"), r["id"]
    assert sum(r["split"] == "test" for r in rows) >= 0.30 * len(rows)
    assert {r["kind"] for r in rows} == {"exception", "silent"}
    assert {"cpu", "cuda"} <= {r["device"] for r in rows}


def test_model_file_is_well_formed_and_shipped() -> None:
    model = load()
    assert model.categories == tuple(CATEGORIES)
    assert len(model.bias) == len(model.categories) and model.temperature > 0
    assert all(len(w) == len(model.categories) for w in model.weights.values())
    assert 0 < model.unsure_below < 1
    # read through importlib.resources, as an installed wheel reads it
    from importlib import resources

    assert resources.files("castwise.diagnosis").joinpath("model.json").is_file()


@pytest.mark.parametrize("blas_kernel", ["", "Haswell"])
def test_model_file_is_what_the_fitting_script_writes(blas_kernel: str) -> None:
    # the cheap form: re-fit with the stored regularisation (the cross-validation that chose it
    # is the script's job); float noise across machines is tolerated, a stale file is not. The
    # second run re-fits on OpenBLAS's AVX2 (Haswell) kernels, as an AVX2-only CI machine does
    env = {**os.environ, "OPENBLAS_CORETYPE": blas_kernel} if blas_kernel else None
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fit_explain.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_refit_check_tells_noise_from_a_stale_file() -> None:
    spec = importlib.util.spec_from_file_location("fit_explain", ROOT / "benchmarks" / "fit_explain.py")
    assert spec is not None and spec.loader is not None
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    stored = json.loads((ROOT / "src" / "castwise" / "diagnosis" / "model.json").read_text())
    noisy, moved, other_data = (copy.deepcopy(stored) for _ in range(3))
    feature = next(iter(stored["weights"]))
    noisy["weights"][feature] = [v + 9e-3 for v in stored["weights"][feature]]  # measured BLAS noise
    moved["weights"][feature] = [v + 0.1 for v in stored["weights"][feature]]
    other_data["meta"]["data_sha256"] = "0" * 64
    assert fit.same(noisy, stored)
    assert not fit.same(moved, stored)
    assert not fit.same(other_data, stored)


def test_probabilities_and_evidence() -> None:
    text = """Traceback (most recent call last):
  File "/home/u/infer.py", line 12, in <module>
    out = model.generate(**inputs)
  File "/env/lib/python3.11/site-packages/peft/tuners/lora/layer.py", line 509, in forward
    result = result + lora_B(lora_A(dropout(x))) * scaling
RuntimeError: expected mat1 and mat2 to have the same dtype, but got: c10::Half != float
"""
    e = explain(text)
    assert e.category == "ADAPTER_DTYPE_MISMATCH" and not e.unsure
    assert 0 < e.confidence <= 1 and sum(c.score for c in e.candidates) <= 1 + 1e-9
    assert any("peft" in why for why in e.evidence)  # the answer names what decided it
    d = e.to_dict()
    assert d["unsure"] is False and d["settle"] == [] and d["evidence"]


def test_unsure_answers_show_three_candidates_and_what_would_settle_it() -> None:
    e = explain("RuntimeError: expected scalar type Half but found Float")
    assert e.unsure and e.confidence < load().unsure_below
    assert len(e.candidates) >= 3
    assert e.settle and all(":" in hint for hint in e.settle)
    out = str(e)
    assert "unsure" in out and "not enough evidence" in out and "castwise.diagnose()" in out
    assert "castwise audit" in out and "what would settle it" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_silent_problems_get_an_answer() -> None:
    black = explain("SDXL renders black images at the end of sampling, no error message. fp16 VAE.")
    assert black.category == "FP16_RANGE_OVERFLOW" and not black.is_dtype_error
    scale = explain(
        "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 1.5e-20\n"
        "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 7.4e-21"
    )
    assert scale.category == "LOSS_SCALE_OR_UNDERFLOW"
    rope = explain(
        "Loss is worse in bf16: the RoPE cos/sin tables are computed in bfloat16 and lose precision "
        "at long context; positions above 256 get rounded."
    )
    assert rope.category == "LOWPREC_ROUNDING"


def test_context_that_changes_the_answer() -> None:
    t4 = explain(
        "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
        "Your Tesla T4 GPU has compute capability 7.5."
    )
    assert t4.category == "DTYPE_UNSUPPORTED_ON_DEVICE" and t4.level == "high"
    cpu = explain("RuntimeError: \"addmm_impl_cpu_\" not implemented for 'Half'")
    assert cpu.category == "DTYPE_UNSUPPORTED_ON_DEVICE"


LLAMA_Q_PROJ = """\
Traceback (most recent call last):
  File "train.py", line 40, in <module>
    out = model(input_ids)
  File "/env/site-packages/transformers/models/llama/modeling_llama.py", line 300, in forward
    query_states = self.q_proj(hidden_states)
  File "/env/site-packages/torch/nn/modules/linear.py", line 114, in forward
    return F.linear(input, self.weight, self.bias)
RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16
"""


def test_a_plain_llama_projection_is_not_an_adapter_problem() -> None:
    # the case: q_proj is a plain Linear here; adapters need peft/LoRA frames or words
    plain = explain(LLAMA_Q_PROJ)
    assert plain.category != "ADAPTER_DTYPE_MISMATCH"
    lora = explain(LLAMA_Q_PROJ.replace("train.py", "finetune_lora.py"))
    assert lora.candidates[0].category == "ADAPTER_DTYPE_MISMATCH"


def test_evidence_is_read_the_same_way_for_fitting_and_answering() -> None:
    # the fitting script reads reports through read_evidence: a feature fired there is scored here
    ev = read_evidence("RuntimeError: Expected counts to have type Half but got Float  # SyncBatchNorm")
    names = {f.name for f in ev.features}
    assert "msg:norm-stats-dtype" in names and "clue:SyncBatchNorm" in names
    assert (
        explain("RuntimeError: Expected counts to have type Half but got Float").category == "NORM_PARAM_OR_STATS_DTYPE"
    )


def test_explain_path_stays_torch_free() -> None:
    code = (
        "import sys; import castwise; castwise.explain('RuntimeError: expected scalar type Half but found "
        "Float'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_silent_report_reads_its_clues_as_silent() -> None:
    text = "Training in fp16 on a V100: the loss becomes nan after 6000 iterations; float32 is fine."
    ev = read_evidence(text)
    names = {f.name for f in ev.features}
    assert "shape:no error message" in names
    assert "silent&clue:GPU without bf16" in names and "clue:GPU without bf16" not in names
    # a GPU without bf16 next to NaN outputs is no missing kernel: that prior is dropped
    silent_gpu = next(f for f in ev.features if f.name == "silent&clue:GPU without bf16")
    assert "DTYPE_UNSUPPORTED_ON_DEVICE" not in silent_gpu.prior
    e = explain(text)
    assert e.category is not None and e.category != "DTYPE_UNSUPPORTED_ON_DEVICE"


def test_an_error_told_in_words_is_not_silent() -> None:
    told = read_evidence("Fine-tuning with bf16 on a Tesla T4 fails with an error at the first step.")
    names = {f.name for f in told.features}
    assert "shape:no error message" not in names and "clue:GPU without bf16" in names
    # no symptom named at all (a PR title): not read as a silent problem either
    assert "shape:no error message" not in {f.name for f in read_evidence("fix float/half issue with scatter").features}


def test_confidence_grows_with_the_margin_over_the_runner_up() -> None:
    from castwise.diagnosis._model import from_dict

    base = load()
    d = {
        "categories": list(base.categories),
        "bias": [0.0] * len(base.categories),
        "weights": {},
        "temperature": 1.0,
        "unsure_below": 0.6,
        "confidence_map": [0.0, 0.0, 1.0],
    }
    model = from_dict(d)
    n = len(base.categories)
    tie = [0.4, 0.4] + [0.2 / (n - 2)] * (n - 2)
    clear = [0.7, 0.1] + [0.2 / (n - 2)] * (n - 2)
    # sigmoid(log(p1 / p2)) = p1 / (p1 + p2): a tie between two causes is a coin toss
    assert abs(max(model.calibrated(tie)) - 0.5) < 1e-9
    assert abs(max(model.calibrated(clear)) - 0.7 / 0.8) < 1e-9
    # a file written before the margin term (two numbers) reads as c = 0
    assert from_dict(d | {"confidence_map": [1.0, 0.0]}).confidence_map == (1.0, 0.0, 0.0)


def test_a_precision_switched_on_in_a_config_is_evidence() -> None:
    text = (
        "# config fp16 setting\nfp16 = dict(loss_scale=512.)\nRuntimeError: expected scalar type Float but found Half"
    )
    assert "clue:precision switched on in a config" in {f.name for f in read_evidence(text).features}
