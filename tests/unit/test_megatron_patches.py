"""megatron_patches: the version gate and the CPU shim (refusal on CUDA, exact undo, idempotence, RNG, Adam)."""

from __future__ import annotations

import importlib.util
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from megatron_patches import _versions, cpu
from megatron_patches._versions import _check
from neighbor_ckpt.errors import NeighborCkptError, UnsupportedPlatformError, UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]

OK = {"megatron-core": "0.15.3", "nemo-toolkit": "2.7.3"}


# -- version gate (pure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("installed, require_nemo", [
    (OK, True),
    (OK, False),
    ({"megatron-core": "0.15.0", "nemo-toolkit": None}, False),
    ({"megatron-core": "0.15.3rc1+local", "nemo-toolkit": "2.7.3"}, True),
])
def test_supported_versions_pass(installed: dict[str, str | None], require_nemo: bool) -> None:
    _check(installed, require_nemo)


def test_wrong_mcore_names_installed_and_supported_and_pin() -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({"megatron-core": "0.17.0", "nemo-toolkit": "2.7.3"}, require_nemo=False)
    msg = str(ei.value)
    assert "megatron-core 0.17.0" in msg and "0.15.x, 0.19.x" in msg and "neighbor-ckpt[megatron]" in msg
    assert isinstance(ei.value, NeighborCkptError)


def test_wrong_nemo_fails_only_when_required(caplog: pytest.LogCaptureFixture) -> None:
    installed = {"megatron-core": "0.15.3", "nemo-toolkit": "2.6.0"}
    with pytest.raises(UnsupportedVersionError) as ei:
        _check(installed, require_nemo=True)
    assert "nemo-toolkit 2.6.0" in str(ei.value) and "2.7.3" in str(ei.value)
    assert "neighbor-ckpt[nemo]" in str(ei.value)
    with caplog.at_level(logging.WARNING, logger=_versions.__name__):
        _check(installed, require_nemo=False)
    assert "nemo-toolkit 2.6.0" in caplog.text


@pytest.mark.parametrize("installed, require_nemo, extra", [
    ({"megatron-core": None, "nemo-toolkit": None}, False, "neighbor-ckpt[megatron]"),
    ({"megatron-core": "0.15.3", "nemo-toolkit": None}, True, "neighbor-ckpt[nemo]"),
    ({"nemo-toolkit": "2.7.3"}, True, "neighbor-ckpt[megatron]"),
])
def test_missing_package_says_which_extra(installed: dict[str, str | None], require_nemo: bool,
                                          extra: str) -> None:
    with pytest.raises(UnsupportedVersionError, match="not installed") as ei:
        _check(installed, require_nemo)
    assert extra in str(ei.value)


def test_check_versions_reads_metadata_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(_versions.importlib.metadata, "version",
                        lambda name: seen.append(name) or {"megatron-core": "0.14.0"}.get(name) or
                        (_ for _ in ()).throw(_versions.importlib.metadata.PackageNotFoundError(name)))
    with pytest.raises(UnsupportedVersionError, match="megatron-core 0.14.0"):
        _versions.check_versions()
    assert set(seen) == set(_versions.SUPPORTED)


# -- the CPU shim ----------------------------------------------------------------------------------------------

needs_mcore = pytest.mark.skipif(importlib.util.find_spec("megatron") is None or
                                 importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install 'neighbor-ckpt[megatron]')")


def _snapshot() -> dict[str, Any]:
    """Identity of every attribute the shim may replace, the mode stack depth, the mcore logger's filters."""
    import importlib

    snap: dict[str, Any] = {}
    for a in cpu.PATCHED_ATTRIBUTES:
        *path, leaf = a.name.split(".")  # "Class.method": an attribute of a class of the module
        owner = importlib.import_module(a.module)
        for part in path:
            owner = getattr(owner, part)
        snap[f"{a.module}.{a.name}"] = owner.__dict__.get(leaf, "<missing>")
    snap["<mode stack>"] = torch._C._len_torch_function_stack()
    snap["<filters>"] = tuple(logging.getLogger("megatron.core.tensor_parallel.random").filters)
    return snap


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if a[k] is not b[k] and a[k] != b[k]]


@pytest.fixture
def shim() -> Iterator[cpu.CpuPatch]:
    before = _snapshot()
    patch = cpu.enable_cpu()
    try:
        yield patch
    finally:
        patch.disable()
        assert not _same(before, _snapshot())


@needs_mcore
def test_refuses_on_cuda_machine_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot()  # imports every patched module first (NeMo's imports probe CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UnsupportedPlatformError, match="smoke runs and tests"):
        cpu.enable_cpu()
    assert not _same(before, _snapshot())
    assert cpu.active_patch() is None


@needs_mcore
def test_enable_disable_restores_every_attribute_exactly() -> None:
    before = _snapshot()
    patch = cpu.enable_cpu()
    during = _snapshot()
    changed = set(_same(before, during))
    assert {f"{a.module}.{a.name}" for a in cpu.PATCHED_ATTRIBUTES} <= changed
    assert "<mode stack>" in changed and "<filters>" in changed
    assert sorted(patch.replaced()) == sorted((a.module, a.name) for a in cpu.PATCHED_ATTRIBUTES)
    patch.disable()
    assert not _same(before, _snapshot())
    assert not patch.active and cpu.active_patch() is None
    patch.disable()  # idempotent
    assert not _same(before, _snapshot())


@needs_mcore
def test_nemo_false_leaves_nemo_alone_and_does_not_import_it() -> None:
    code = ("import sys; from megatron_patches import cpu; p = cpu.enable_cpu(nemo=False); "
            "assert not any(m.startswith('nemo') for m in sys.modules), 'nemo imported'; "
            "assert all(m != 'nemo.lightning.megatron_init' for m, _ in p.replaced()); "
            "assert len(p.replaced()) == sum(a.framework is None for a in cpu.PATCHED_ATTRIBUTES); p.disable()")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_mcore
def test_idempotent_and_context_manager() -> None:
    before = _snapshot()
    with cpu.enable_cpu() as p1:
        p2 = cpu.enable_cpu()
        assert p2 is p1 and cpu.active_patch() is p1
        assert torch._C._len_torch_function_stack() == before["<mode stack>"] + 1
    assert not _same(before, _snapshot())
    p3 = cpu.enable_cpu()
    try:
        assert p3 is not p1 and p3.active
    finally:
        p3.disable()


@needs_mcore
def test_disable_keeps_modes_pushed_above() -> None:
    class Other(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    depth = torch._C._len_torch_function_stack()
    patch = cpu.enable_cpu()
    with Other():
        patch.disable()
        assert torch._C._len_torch_function_stack() == depth + 1
        assert isinstance(torch._C._get_function_stack_at(depth), Other)
    assert torch._C._len_torch_function_stack() == depth


@needs_mcore
def test_device_mapping(shim: cpu.CpuPatch) -> None:
    assert torch.cuda.is_available() is False
    for dev in ("cuda", "cuda:0", torch.device("cuda"), 0, torch.cuda.current_device()):
        assert torch.zeros(2, device=dev).device.type == "cpu"
    x = torch.ones(3)
    assert x.cuda() is x and x.to("cuda") is x and x.to(0) is x and x.pin_memory() is x
    assert x.to("cuda", torch.float64).dtype == torch.float64
    assert torch.tensor([1.0], device="cuda").is_cuda is False
    assert torch.empty(2, pin_memory=True).is_pinned() is False
    assert x.type() == "torch.cuda.FloatTensor" and x.half().type() == "torch.cuda.HalfTensor"
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    m = torch.nn.Linear(2, 2).cuda(torch.cuda.current_device())
    assert next(m.parameters()).device.type == "cpu"
    m.to("cuda").to(0).to(torch.device("cuda", 0), torch.float64)
    assert next(m.parameters()).device.type == "cpu" and next(m.parameters()).dtype == torch.float64
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    torch.cuda.synchronize()
    assert e.query()


@needs_mcore
def test_cuda_rng_is_the_cpu_generator_and_tracker_states_round_trip(shim: cpu.CpuPatch) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
    tracker = mrandom.get_cuda_rng_tracker()
    saved_tracker = {k: v.clone() for k, v in tracker.get_states().items()}
    saved_default = torch.get_rng_state()

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        with tracker.fork():
            inside = torch.nn.functional.dropout(torch.ones(256), 0.5)
        outside = torch.nn.functional.dropout(torch.ones(256), 0.5)
        return inside, outside

    before_fork = torch.get_rng_state()
    with tracker.fork():
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before_fork), "fork must restore the default stream"
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], saved_tracker["model-parallel-rng"])

    tracker.set_states({k: v.clone() for k, v in saved_tracker.items()})
    torch.set_rng_state(saved_default)
    a_in, a_out = draw()
    after = ({k: v.clone() for k, v in tracker.get_states().items()}, torch.get_rng_state())
    tracker.set_states({k: v.clone() for k, v in saved_tracker.items()})
    torch.cuda.set_rng_state(saved_default)
    b_in, b_out = draw()
    assert torch.equal(a_in, b_in) and torch.equal(a_out, b_out)
    assert not torch.equal(a_in, a_out), "inside and outside the fork draw from different streams"
    assert all(torch.equal(after[0][k], v) for k, v in tracker.get_states().items())
    assert torch.equal(after[1], torch.get_rng_state())


@needs_mcore
def test_fork_warning_is_filtered(shim: cpu.CpuPatch, caplog: pytest.LogCaptureFixture) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with caplog.at_level(logging.WARNING, logger=mrandom.__name__):
        with mrandom.get_cuda_rng_tracker().fork():
            torch.nn.functional.dropout(torch.ones(8), 0.5)
    assert "CPU RNG state changed" not in caplog.text


@needs_mcore
@pytest.mark.parametrize("adam_w_mode, ref_cls", [(False, torch.optim.Adam), (True, torch.optim.AdamW)])
def test_fused_adam_semantics(adam_w_mode: bool, ref_cls: type) -> None:
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(50, generator=g)
    grads = [torch.randn(50, generator=g) for _ in range(5)]
    mine, ref = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt = cpu.FusedAdamSemanticsAdam([mine, torch.zeros(0)], lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    opt.add_param_group({"params": []})
    ref_opt = ref_cls([ref], lr=1e-2, weight_decay=0.1)
    for gr in grads:
        mine.grad, ref.grad = gr.clone(), gr.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["step"] == 5 and "step" not in opt.param_groups[1]
    assert set(opt.state[mine]) == {"exp_avg", "exp_avg_sq"}
    sd = opt.state_dict()
    assert sd["param_groups"][0]["step"] == 5 and set(sd["state"][0]) == {"exp_avg", "exp_avg_sq"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_mcore
def test_one_rank_gpt_trains_with_distributed_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 1-rank mcore GPTModel + DDP + DistributedOptimizer, in process, under the shim."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with cpu.enable_cpu():
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            torch.manual_seed(1)
            tensor_parallel.model_parallel_cuda_manual_seed(1, force_reset_rng=True)
            config = TransformerConfig(
                num_layers=1, hidden_size=32, num_attention_heads=2, attention_dropout=0.1, hidden_dropout=0.1,
                use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                apply_rope_fusion=False)
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                             max_sequence_length=16).cuda()
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                          model)
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                         clip_grad=1.0), [ddp])
            assert isinstance(opt.optimizer, cpu.FusedAdamSemanticsAdam)
            opt.state_dict()  # with torch Adam this asserts before the first step
            config.finalize_model_grads_func = finalize_model_grads
            tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

            def step_fn(it, m):  # noqa: ANN001, ANN202
                next(it)
                out = m(tokens[:, :-1], torch.arange(16).expand(2, 16), None, labels=tokens[:, 1:])
                return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

            losses = []
            for _ in range(3):
                ddp.zero_grad_buffer()
                opt.zero_grad()
                out = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=iter(range(1)),
                                                  model=[ddp], num_microbatches=1, seq_length=16,
                                                  micro_batch_size=2, forward_only=False)
                ok, _, _ = opt.step()
                assert ok
                losses.append(float(out[0]["loss"]))
            assert losses[-1] < losses[0]
            sd = opt.state_dict()
            assert {g["step"] for g in sd["optimizer"]["param_groups"]} == {3}
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


# -- step tags and training-traffic hooks ------------------------------------------------------------------------

class _Gate:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def train_begin(self) -> None:
        self.log.append("closed")

    def train_end(self) -> None:
        self.log.append("open")


class _Ckpt:
    """Records what the hooks call, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gate = _Gate(self.log)

    def wait(self) -> None:
        self.log.append("wait")

    def begin_optimizer_step(self) -> None:
        self.log.append("begin")

    def end_optimizer_step(self) -> None:
        self.log.append("end")


@needs_mcore
def test_step_tags_wrap_one_optimizer_instance_and_are_reversible() -> None:
    from megatron_patches.step_tags import tag_optimizer_steps

    class Opt:
        def step(self) -> str:
            ckpt.log.append("step")
            return "ok"

    ckpt, opt, other = _Ckpt(), Opt(), Opt()
    tags = tag_optimizer_steps(opt, on_enter=ckpt.begin_optimizer_step, on_exit=ckpt.end_optimizer_step)
    assert opt.step() == "ok" and ckpt.log == ["begin", "step", "end"]
    other.step()
    assert ckpt.log[-1] == "step", "another instance of the class is not tagged"
    tags.remove()
    tags.remove()  # idempotent
    assert "step" not in vars(opt) and type(opt).step is Opt.step


@needs_mcore
def test_traffic_hooks_close_the_gate_during_collectives_wait_first_and_are_reversible() -> None:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    from megatron_patches.traffic import mark_training_traffic

    names = ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync")
    before = {n: Group.__dict__[n] for n in names}
    ckpt = _Ckpt()
    hooks = mark_training_traffic(ckpt.gate, before_grad_sync=ckpt.wait)
    assert all(Group.__dict__[n] is not before[n] for n in names)
    fake = object.__new__(Group)  # the wrappers only look at the handles; the originals are stubbed below
    fake.grad_reduce_handle = None
    fake.param_gather_handle = None
    from megatron_patches import traffic

    saved = dict(traffic._originals)
    traffic._originals.update({n: (lambda self, *a, **k: ckpt.log.append("collective")) for n in names})
    try:
        Group.start_grad_sync(fake)
        Group.start_param_sync(fake)
    finally:
        traffic._originals.update(saved)
    assert ckpt.log == ["wait", "closed", "collective", "open", "closed", "collective", "open"]
    hooks.remove()
    hooks.remove()
    assert all(Group.__dict__[n] is before[n] for n in names)


def test_fp32_distopt_load_patch_runs_the_state_copy_without_autograd_and_is_reversible() -> None:
    """The copy mcore 0.15 does into fp32 main params (views of leaf parameters) fails with autograd on; under the
    patch it runs under no_grad, once per process, and remove() puts the original back."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patches.distopt_load import fix_fp32_distopt_load, without_autograd

    leaf = torch.nn.Parameter(torch.zeros(8))

    def copy_into_main_param(src: torch.Tensor) -> None:  # what mcore's method body does
        leaf.view(-1)[2:6].copy_(src)

    with pytest.raises(RuntimeError, match="leaf Variable"):
        copy_into_main_param(torch.ones(4))
    without_autograd(copy_into_main_param)(torch.ones(4))
    assert leaf.detach().tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and leaf.requires_grad

    original = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]
    patch = fix_fp32_distopt_load()
    try:
        assert fix_fp32_distopt_load() is patch
        assert DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"].__wrapped__ is original
    finally:
        patch.remove()
    assert DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"] is original


# -- FusedAdam semantics on a GPU image without TE / apex ------------------------------------------------------

@needs_mcore
def test_fused_adam_patch_replaces_exactly_the_optimizer_attributes_and_restores_them() -> None:
    from megatron_patches import fused_adam

    if cpu.active_patch() is not None:
        pytest.skip("the CPU shim is active in this process (it already applies these attributes)")
    before = _snapshot()
    patch = fused_adam.use_fused_adam_semantics()
    assert patch is not None, "neither Transformer Engine nor apex is installed here: mcore fell back to torch Adam"
    assert set(_same(before, _snapshot())) == {f"{a.module}.{a.name}" for a in fused_adam.OPTIMIZER_ATTRIBUTES}
    import megatron.core.optimizer as mo

    assert mo.Adam is cpu.FusedAdamSemanticsAdam and mo.USING_PYTORCH_OPTIMIZER is False
    assert fused_adam.use_fused_adam_semantics() is None  # mcore now believes it has FusedAdam: nothing to do
    patch.restore()
    assert not _same(before, _snapshot())
