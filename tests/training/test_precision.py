"""Precision decided once: fp32 / bf16 / fp16, the apex alias, GPU capabilities, backends."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from audioclf.config import TrainConfig
from audioclf.precision import (
    EXACT,
    BackendFlags,
    configure_backends,
    exact_arithmetic,
    resolve_precision,
)
from tests.helpers import (
    ROOT,
    answers_in_threads,
    fit,
    mixed_precision_steps,
    tiny_config,
    train_resume_export,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "overrides, name, dtype, scaler",
    [
        ({}, "fp32", None, False),
        ({"precision": "bf16"}, "bf16", torch.bfloat16, False),
        ({"precision": "fp16"}, "fp16", torch.float16, True),
        ({"opt_level": "O0", "precision": "bf16"}, "fp32", None, False),
        ({"opt_level": "O1"}, "fp16", torch.float16, True),
    ],
)
def test_precision_resolution(overrides, name, dtype, scaler):
    p = resolve_precision(TrainConfig(**overrides), CPU)
    assert (p.name, p.dtype, p.scaler.is_enabled()) == (name, dtype, scaler)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_apex_o2_o3_map_to_o1_with_warning(level):
    with pytest.warns(UserWarning, match=f"opt_level={level}.*no torch.amp equivalent"):
        p = resolve_precision(TrainConfig(opt_level=level), CPU)
    assert p.name == "fp16"


def test_bf16_autocast_context_is_active():
    p = resolve_precision(TrainConfig(precision="bf16"), CPU)
    with p.autocast():
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16


def test_bf16_on_a_gpu_that_only_emulates_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match="bf16 needs a GPU with native bfloat16.*Tesla T4.*fp16"):
        resolve_precision(TrainConfig(precision="bf16"), torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_precision(TrainConfig(precision="bf16"), torch.device("cuda", 0)).name == "bf16"


def test_tf32_and_cudnn_benchmark_follow_the_config():
    flags = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        configure_backends(TrainConfig(), CPU)  # nothing to set on the CPU
        assert not torch.backends.cuda.matmul.allow_tf32
        configure_backends(TrainConfig(), torch.device("cuda", 0))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
        configure_backends(TrainConfig(tf32=False, deterministic=True), torch.device("cuda", 0))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.benchmark
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = flags


@pytest.mark.slow  # a training in this process
def test_a_run_puts_back_the_backend_flags_it_found(tmp_path, tiny_demo):
    # A run in this process (a benchmark cell, the cuda tests' trainings) turned TF32 and cuDNN
    # autotuning on for good: exact search after it missed its 1e-5 tolerance. On a CPU the
    # run sets nothing, so the hook turns them on as configure_backends does on a GPU.
    from audioclf.training.trainer import TrainHooks

    saved, during = BackendFlags.current(), []

    def turn_on(trainer):
        BackendFlags(True, True, True).apply()
        during.append(BackendFlags.current())

    try:
        BackendFlags(False, False, False).apply()
        cfg = tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=1", "train.limit_batches=2")
        fit(cfg, TrainHooks(on_step=turn_on))
        after = BackendFlags.current()
    finally:
        saved.apply()
    assert during and after == BackendFlags(False, False, False)


@pytest.mark.slow  # a training in this process
def test_validation_embeds_in_fp32_whatever_the_training_precision(tmp_path, tiny_demo):
    # Validation's figures pick best.pt: they are evaluate's, which embeds in fp32. It embedded
    # under the run's autocast (bf16 here).
    from audioclf import distributed
    from audioclf.training.trainer import TrainHooks

    forwards = []  # (training mode, autocast on) of each forward of the embedder after step 1

    def watch(trainer):
        if not forwards:
            embedder = distributed.unwrap(trainer.model).embedder
            embedder.register_forward_pre_hook(
                lambda module, args: forwards.append(
                    (module.training, torch.is_autocast_enabled("cpu"))
                )
            )
            forwards.append(("hooked", None))

    extra = ["train.epochs=1", "train.limit_batches=2", "train.precision=bf16", "eval.every=1"]
    summary = fit(tiny_config(tiny_demo, tmp_path, "cnn", *extra), TrainHooks(on_step=watch))
    assert summary["metrics"]["map_at_r"] > 0
    assert (True, True) in forwards  # training steps in bf16
    assert (False, True) not in forwards and (False, False) in forwards  # validation in fp32


def test_auto_fits_the_device(monkeypatch):
    cpu = resolve_precision(TrainConfig(precision="auto"), CPU)
    assert cpu.name == "fp32" and "slower" in cpu.reason
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_precision(TrainConfig(precision="auto"), torch.device("cuda", 0)).name == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    older = resolve_precision(TrainConfig(precision="auto"), torch.device("cuda", 0))
    assert older.name == "fp16" and "Some GPU" in older.reason  # (GradScaler needs a real GPU)


def test_explicit_bf16_on_a_cpu_runs_with_one_warning_giving_the_cost():
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the audioclf logger may not propagate (setup_logging)
    logger = logging.getLogger("audioclf")
    logger.addHandler(handler)
    try:
        assert resolve_precision(TrainConfig(precision="bf16"), CPU).name == "bf16"
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1 and "precision=bf16 on a CPU: " in warnings[0]
    assert "44-51 s against 2.3-4.8 s" in warnings[0]


def test_the_gpu_recipes_choose_fp32_on_a_cpu():

    from audioclf.config import load_config

    root = ROOT
    for recipe in ("cnn", "conformer"):
        cfg = load_config(root / "configs" / f"{recipe}.yaml")
        assert cfg.train.precision == "auto"
        assert resolve_precision(cfg.train, CPU).name == "fp32"


def test_embedding_extraction_runs_without_tf32_or_autotuning():
    # Validation clips vary in length (autotuning would re-tune per batch), and validation's
    # numbers pick best.pt: they must be evaluate's, computed without TF32. Settings return.
    from audioclf.inference import embed_dataset

    seen = []

    def embed(x, lengths):
        backends = torch.backends
        seen.append(
            (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark)
        )
        return x.mean(dim=1)

    items = [(torch.randn(5, 3), 0, i) for i in range(4)]
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    try:
        configure_backends(TrainConfig(tf32=True, cudnn_benchmark=True), CPU)  # CPU: a no-op
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # as configure_backends leaves a CUDA run
        emb, _, _ = embed_dataset(embed, items, batch_size=2)
        after = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        )
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = saved
    assert emb.shape == (4, 3) and seen == [(False, False, False)] * 2
    assert after == (True, True, True)


@pytest.mark.slow  # reduced precision is emulated on the CPU: seconds per case
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["cnn", "conformer"])
def test_mixed_precision_steps_learn_on_the_cpu(model, precision):
    # The CPU twin of test_cuda's test (fp16 autocast and GradScaler exist on the CPU too).
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    run = mixed_precision_steps(model, precision, CPU)
    assert run["steps"] == 6 and run["loss_finite"] and run["consecutive_bad"] == 0
    assert run["learned"] and run["weights_finite"] and run["fused"]
    assert run["embedding_layer_dtypes"] == {dtype}
    # CPU autocast keeps F.normalize in the reduced dtype (CUDA's runs it in fp32); the losses
    # compute in fp32 either way.
    assert run["output_dtypes"] == {dtype}


@pytest.mark.slow  # two trainings and two exports
def test_an_fp16_checkpoint_resumes_in_fp32_and_exports(tmp_path, tiny_demo):
    # The CPU twin of test_cuda's GPU checkpoint test: GradScaler state and the fused AdamW
    # written in fp16, resumed in fp32, exported with parity.
    run = train_resume_export(tiny_demo, tmp_path, "cpu", "fp16")
    assert run["fused"] and run["steps"] == 2 * run["first_steps"]
    assert max(run["parity"].values()) <= 1e-4


TF32_ON = BackendFlags(True, True, True)  # what a training's configure_backends leaves on


def test_a_thread_leaving_exact_arithmetic_keeps_it_for_a_thread_still_inside():
    # serve's batcher and search threads enter and leave at will: each thread saved and
    # restored the process-wide flags, so the first to leave turned TF32 back on under the
    # other's batch (issue 42; issue 43 item 7). On a CPU the flags are plain attributes.
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with exact_arithmetic():
            first_in.set()
            assert second_in.wait(30)
        first_out.set()

    def second() -> BackendFlags:
        assert first_in.wait(30)
        with exact_arithmetic():
            second_in.set()
            assert first_out.wait(30)
            return BackendFlags.current()

    saved = BackendFlags.current()
    try:
        TF32_ON.apply()
        with ThreadPoolExecutor(2) as pool:
            left, inside = pool.submit(first), pool.submit(second)
            left.result(60)
            seen_inside = inside.result(60)
        after = BackendFlags.current()
    finally:
        saved.apply()
    assert seen_inside == EXACT
    assert after == TF32_ON  # put back when the last thread left


def test_four_threads_in_exact_arithmetic_all_see_exact_flags():
    def flags_inside(pause: float) -> BackendFlags:
        with exact_arithmetic():
            time.sleep(pause)
            return BackendFlags.current()

    saved = BackendFlags.current()
    try:
        TF32_ON.apply()
        pauses = [0.0, 0.001, 0.002, 0.003]
        serial = [flags_inside(p) for p in pauses]
        answers = answers_in_threads(flags_inside, pauses)
        after = BackendFlags.current()
    finally:
        saved.apply()
    assert serial == [EXACT] * len(pauses)
    assert all(thread == serial * 10 for thread in answers)
    assert after == TF32_ON
