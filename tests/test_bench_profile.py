"""`gpt2train bench profile`: kernels sorted into categories by name and by the operators they ran under, and a
tiny real profile of two configs through the trainer that writes its JSON and table."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from conftest import tiny_config
from gpt2train import cli
from gpt2train.bench.profile import CATEGORIES, categorize, kernels_of
from gpt2train.config import save_config


@pytest.mark.parametrize("name, category", [
    # CUDA kernels as the profiler names them (cuBLAS, flash attention, triton from torch.compile, ATen)
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, false>(Flash_fwd_params)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "attention"),
    ("triton_per_fused__log_softmax_nll_loss_forward_3", "softmax/cross-entropy"),
    ("triton_red_fused_add_native_layer_norm_2", "normalization"),
    ("triton_poi_fused_add_gelu_4", "elementwise"),
    ("triton_tem_fused_mm_7", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>", "other"),
    # CPU operators
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::add_", "elementwise"), ("aten::_to_copy", "elementwise"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::native_layer_norm", "normalization"),
    ("aten::rms_norm", "normalization"), ("aten::_log_softmax", "softmax/cross-entropy"),
    ("aten::_foreach_norm", "optimizer"), ("aten::embedding", "other"),
    ("autograd::engine::evaluate_function: MmBackward0", "other"),  # the bookkeeping around it, not the matmul
])
def test_a_kernel_goes_to_its_category_by_name(name, category):
    assert categorize(name) == category


def test_what_an_optimizer_step_launches_is_optimizer_time():
    """Muon's orthogonalization is matmuls: under Optimizer.step they count as the optimizer's."""
    assert categorize("aten::mm", ["aten::matmul", "Optimizer.step#Muon.step"]) == "optimizer"
    assert categorize("sm90_xmma_gemm_bf16", ["aten::mm", "Optimizer.step#Muon.step", "train_step"]) == "optimizer"
    assert categorize("aten::mm", ["aten::matmul", "aten::linear"]) == "matmul"


def event(name, parent=None, kernels=(), us=0.0):
    """A host event of torch.profiler's events(), with the fields kernels_of reads; `kernels`: (name, microseconds)
    of the device kernels it launched."""
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, is_async=False,
                           is_user_annotation=False, self_cpu_time_total=us,
                           kernels=[SimpleNamespace(name=n, device=0, duration=d) for n, d in kernels])


def test_a_device_kernel_takes_the_operators_of_the_call_that_launched_it():
    """On a GPU the kernels are the device's; torch hangs each on its launch on the host, and the launch's
    operators decide whether a matmul is the optimizer's."""
    step = event("Optimizer.step#Muon.step")
    muon_launch = event("cudaLaunchKernel", event("aten::mm", step), [("sm90_xmma_gemm_bf16", 5.0)])
    model_launch = event("cudaLaunchKernel", event("aten::mm", event("aten::linear")), [("sm90_xmma_gemm_bf16", 3.0)])
    copy_launch = event("cudaMemcpyAsync", event("aten::copy_"), [("Memcpy HtoD (Pinned -> Device)", 1.0)])
    kernels, source = kernels_of([step, muon_launch, model_launch, copy_launch])
    assert [(k.category, k.us) for k in kernels] == [("optimizer", 5.0), ("matmul", 3.0), ("memcpy", 1.0)]
    assert source.startswith("device kernels")
    kernels, source = kernels_of([event("aten::mm", step, us=2.0), event("aten::add_", us=1.0)])  # a CPU's
    assert [(k.category, k.us) for k in kernels] == [("optimizer", 2.0), ("elementwise", 1.0)]
    assert source.startswith("operators' self CPU time")


@pytest.mark.slow
def test_profile_of_two_configs_sums_its_categories_and_writes_its_files(char_data, tmp_path, capsys):
    base = tiny_config(char_data)
    modern = copy.deepcopy(base)
    modern.train.optimizer = "muon"
    modern.model.qk_norm, modern.model.mlp = True, "relu2"
    save_config(base, tmp_path / "base.toml")
    save_config(modern, tmp_path / "modern.toml")
    out = tmp_path / "out"
    assert cli.main(["bench", "profile", "--config", str(tmp_path / "base.toml"), "--config", str(tmp_path / "modern.toml"),
                     "--data", str(char_data), "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    assert "| optimizer (AdamW, Muon, clipping) |" in capsys.readouterr().out
    result = json.loads((out / "profile.json").read_text())
    assert (out / "profile.md").read_text() == result["markdown"]
    assert [p["config"] for p in result["configs"]] == [str(tmp_path / "base.toml"), str(tmp_path / "modern.toml")]
    for p in result["configs"]:
        assert list(p["categories"]) == CATEGORIES
        assert sum(p["categories"].values()) == pytest.approx(p["kernel_ms"])
        assert p["kernel_ms"] > 0 and p["categories"]["matmul"] > 0 and p["categories"]["optimizer"] > 0
        assert p["step_ms"] > 0 and p["tokens_per_s"] == pytest.approx(p["tokens_per_step"] / p["step_ms"] * 1000)
        assert 0 < p["mfu"] < 1 and p["kernel_source"].startswith("operators' self CPU time")
        assert p["tokens_per_step"] == 4 * 32 and p["top"]
