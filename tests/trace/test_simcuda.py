"""The simulated CUDA GPU: model code that asks torch about the GPU, or enters its own
``autocast("cuda")``, runs the path it would run on a real one, and nothing outlives the audit."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import castwise
from castwise import devices
from castwise.trace import simcuda


def _cuda_functions() -> dict[str, Any]:
    return {name: getattr(torch.cuda, name) for name in simcuda.PATCHED}


def _autocast_f16(x: torch.Tensor) -> Any:
    return torch.autocast("cuda", dtype=torch.float16)


def _amp_autocast_f16(x: torch.Tensor) -> Any:
    # diffusers' training scripts: the device type read off a tensor
    return torch.amp.autocast(device_type=x.device.type, dtype=torch.float16)


def _cuda_amp_autocast_f16(x: torch.Tensor) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated
        return torch.cuda.amp.autocast(dtype=torch.float16)


def _autocast_bf16(x: torch.Tensor) -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16)


ENTRIES = [_autocast_f16, _amp_autocast_f16, _cuda_amp_autocast_f16, _autocast_bf16]


@pytest.mark.parametrize("policy", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("enter", ENTRIES, ids=lambda f: f.__name__.strip("_"))
def test_the_models_own_cuda_autocast_is_on_in_a_simulated_cuda_run(
    enter: Callable[[torch.Tensor], Any], policy: str
) -> None:
    seen: list[torch.dtype] = []

    class OwnAutocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)  # the policy's autocast dtype
            with enter(x):
                out = self.b(h)  # the model's own: a GPU casts both operands to its dtype
            seen.append(out.dtype)
            return out

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "CUDA is not available ... Disabling autocast"
        report = castwise.audit(OwnAutocast(), torch.randn(2, 8), policy=policy, device="cuda", mode="eval")
    assert report.ok, str(report)
    want = torch.bfloat16 if enter is _autocast_bf16 else torch.float16
    assert seen == [want]


class _OwnRegions(nn.Module):
    """A model whose own autocast region leaves a real fault on any GPU: f16 out of the region
    into an f32 layer (``after``), or bf16 into an f32 layer in a region it turned autocast off."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.a, self.b, self.fault = nn.Linear(8, 8), nn.Linear(8, 8), fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault == "after":
            with torch.autocast("cuda", dtype=torch.float16):
                h = self.a(x)
            return self.b(h)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = self.a(x)
            with torch.autocast("cuda", enabled=False):
                return self.b(h)


@pytest.mark.parametrize("fault", ["after", "disabled"])
def test_a_real_fault_around_the_models_own_autocast_is_still_found(fault: str) -> None:
    report = castwise.audit(_OwnRegions(fault), torch.randn(2, 8), device="cuda", mode="eval")
    assert [f.code for f in report.errors] == ["CW110"], str(report)
    assert report.errors[0].module == "b"


def test_code_that_asks_about_the_gpu_takes_the_gpu_branch_and_the_answers_are_restored() -> None:
    asked: list[Any] = []

    class Asks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cuda = torch.cuda
            props = cuda.get_device_properties(x.device)
            asked.extend(
                [
                    cuda.is_available(),
                    cuda.device_count(),
                    cuda.current_device(),
                    cuda.get_device_capability(),
                    cuda.get_device_name(0),
                    (props.major, props.minor, props.multi_processor_count),
                    cuda.is_bf16_supported(),
                    cuda.is_bf16_supported(including_emulation=False),
                ]
            )
            # the GPU branch: bf16 where the GPU runs it
            low = torch.bfloat16 if cuda.is_available() and cuda.is_bf16_supported() else torch.float32
            return self.lin(x.to(low))

    host = (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.is_bf16_supported())
    before = _cuda_functions()
    device_init = FakeTensorMode.__dict__["avoid_device_init"]  # the run answers for this machine
    report = castwise.audit(Asks(), torch.randn(2, 8), device="cuda", mode="eval")
    gpu = [True, 1, 0, (9, 0), "NVIDIA H100 80GB HBM3", (9, 0, 132), True, True]
    assert asked and asked == gpu * (len(asked) // len(gpu))  # each run the audit made asked
    # the GPU branch fed bf16 into the f32 layer: the real error a GPU would raise
    assert [f.code for f in report.errors] == ["CW110"], str(report)
    assert _cuda_functions() == before
    assert (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.is_bf16_supported()) == host
    assert FakeTensorMode.__dict__["avoid_device_init"] is device_init


def test_the_simulation_is_undone_when_the_run_raises() -> None:
    before = _cuda_functions()
    default_type = torch.utils.checkpoint.DefaultDeviceType._default_device_type
    device_init = FakeTensorMode.__dict__["avoid_device_init"]
    with pytest.raises(ValueError, match="boom"), simcuda.simulated_cuda(devices.CUDA):
        assert torch.cuda.is_available()
        assert FakeTensorMode(allow_non_fake_inputs=True).avoid_device_init == (not simcuda.host_has_cuda())
        torch.utils.checkpoint.DefaultDeviceType.get_device_type()  # caches what it found
        raise ValueError("boom")
    assert _cuda_functions() == before
    assert FakeTensorMode.__dict__["avoid_device_init"] is device_init
    assert torch.utils.checkpoint.DefaultDeviceType._default_device_type == default_type


def test_the_gpu_random_state_and_device_context_work_without_a_driver() -> None:
    queued = (len(torch.cuda._queued_calls), torch.cuda._lazy_seed_tracker.get_calls())
    states: list[torch.Tensor] = []

    class Seeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.manual_seed(0)  # seeds every CUDA device too
            with torch.cuda.device(x.device), torch.random.fork_rng(device_type="cuda"):
                torch.cuda.manual_seed(1)
                states.append(torch.cuda.get_rng_state())
                torch.cuda.set_rng_state(states[0], x.device)
            states.append(torch.cuda.get_rng_state(0))
            return self.lin(x)

    report = castwise.audit(Seeds(), torch.randn(2, 8), device="cuda", mode="eval")
    assert report.ok, str(report)
    assert [s.dtype for s in states] == [torch.uint8, torch.uint8]
    assert not torch.equal(states[0], states[1])  # fork_rng put seed 0's state back
    assert (len(torch.cuda._queued_calls), torch.cuda._lazy_seed_tracker.get_calls()) == queued


@pytest.mark.parametrize("nvml_check", ["0", "1"])
def test_a_constant_made_on_the_simulated_gpu_stays_fake(nvml_check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # with the NVML check, torch's own is_available() asks device_count(), which the simulation
    # answers: whether this machine has a GPU must not be read from it
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", nvml_check)

    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            empty = torch.tensor([], dtype=x.dtype, device=x.device)  # transformers' cache starts so
            # made on the CPU, then moved: the fake mode must not move it to a real GPU
            two = torch.tensor([2.0]).to(x.device)
            return torch.cat([empty, (self.lin(x) * two + torch.ones(8, device="cuda")).flatten()])

    report = castwise.audit(Constant(), torch.randn(2, 8), device="cuda", mode="both")
    assert report.ok, str(report)


def test_the_properties_of_an_unlisted_capability_name_it() -> None:
    props = simcuda.properties_of((8, 7))
    assert (props.major, props.minor, props.name) == (8, 7, "simulated CUDA device (sm_87)")
    assert simcuda.properties_of((8, 0)).name == "NVIDIA A100-SXM4-80GB"


class _TextToImageStep(nn.Module):
    """diffusers' train_text_to_image step: the f32 UNet under the script's own autocast, fed the
    text encoder's f16 states."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(
            sample_size=8,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        )

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=latents.device.type, dtype=torch.float16):
            pred = self.unet(latents, timesteps, states.half()).sample
        return nn.functional.mse_loss(pred.float(), latents)


def test_a_diffusers_unet_under_the_training_scripts_autocast_is_clean_on_simulated_cuda() -> None:
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.randn(2, 6, 32))
    report = castwise.audit(_TextToImageStep(), inputs, device="cuda", mode="train")
    assert report.ok, str(report)
