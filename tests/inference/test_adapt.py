"""AdaBN (audioclf.models.adapt): BatchNorm statistics re-estimated on unlabelled clips, checked
against a plain loop over the clips; an adapted model exports with parity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
from torch import nn

import audioclf
from audioclf.export import main as export_main
from audioclf.inference import load_trained
from audioclf.inference.artefacts import describe_adaptation
from audioclf.models.adapt import adapt_batchnorm, batchnorm_layers, same_length_batches
from tests.helpers import make_checkpoint


def new_source_clips(count: int = 5, seed: int = 0) -> list[torch.Tensor]:
    """Clips of another 'source': louder, tilted noise of different lengths (8 kHz)."""
    generator = torch.Generator().manual_seed(seed)
    clips = []
    for i in range(count):
        n = 3000 + 900 * i
        clips.append(0.5 * torch.randn(n, generator=generator).cumsum(0) / 30.0)
    return clips


def layer_inputs_loop(net: nn.Module, clips: list[torch.Tensor]) -> list[np.ndarray]:
    """Per BatchNorm layer: its input over all clips as [channels, values], clip by clip."""
    layers = batchnorm_layers(net)
    seen: list[list[np.ndarray]] = [[] for _ in layers]
    handles = [
        layer.register_forward_pre_hook(
            lambda _m, args, k=k: seen[k].append(
                args[0].transpose(0, 1).reshape(args[0].shape[1], -1).double().numpy()
            )
        )
        for k, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for clip in clips:
            net.embed(clip[None], torch.tensor([clip.shape[0]]))
    for handle in handles:
        handle.remove()
    return [np.concatenate(parts, axis=1) for parts in seen]


@pytest.mark.parametrize("early_norm", ["batch", "subspectral"])
def test_adabn_statistics_are_each_layers_input_over_the_clips(tmp_path, early_norm):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn", model={"early_norm": early_norm})
    net, _, _ = load_trained(ckpt)
    before = [layer.running_mean.clone() for layer in batchnorm_layers(net)]
    clips = new_source_clips()
    record = adapt_batchnorm(net, clips)
    layers = batchnorm_layers(net)
    assert record == {"method": "adabn", "clips": 5, "batchnorm_layers": len(layers)}
    # The adapted model's own inputs to each layer: what inference sees after adaptation.
    for layer, values, old in zip(layers, layer_inputs_loop(net, clips), before, strict=True):
        mean = values.mean(axis=1)
        variance = ((values - mean[:, None]) ** 2).mean(axis=1)
        np.testing.assert_allclose(layer.running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.running_var.numpy(), variance, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(layer.running_mean, old)
    assert not net.training


def test_adaptation_changes_embeddings_and_needs_clips(tmp_path):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    net, _, _ = load_trained(ckpt)
    adapted, _, _ = load_trained(ckpt)
    x, lengths = torch.randn(2, 4000) * 0.1, torch.tensor([4000, 2500])
    adapt_batchnorm(adapted, new_source_clips())
    with torch.no_grad():
        assert (adapted.embed(x, lengths) - net.embed(x, lengths)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="at least one clip"):
        adapt_batchnorm(adapted, [])


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_export_adapt_writes_the_adapted_model_and_says_so(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    write_wavs(tmp_path / "new_source", new_source_clips())
    model = audioclf.load(ckpt)
    record = model.adapt(tmp_path / "new_source")
    x, lengths = torch.randn(3, 5000) * 0.1, torch.tensor([5000, 4100, 3000])
    with torch.no_grad():
        expected = model.loaded.network.embed(x, lengths)
    for fmt, out in (("torchscript", tmp_path / "adapted.pt"), ("state_dict", tmp_path / "w.pt")):
        args = ["--checkpoint", str(ckpt), "--format", fmt, "--out", str(out)]
        assert export_main([*args, "--adapt", str(tmp_path / "new_source")]) == 0
        printed = capsys.readouterr().out
        assert f"adapted first: adapted by adabn on 5 unlabelled clips of {tmp_path}" in printed
        sidecar = json.loads(out.with_name(out.name + ".json").read_text())
        assert sidecar["adaptation"] == record and sidecar["parity"]["max_abs_diff"] <= 1e-4
        exported = audioclf.load(out).loaded  # says what it was adapted on, as the model did
        assert exported.adaptation == record
        assert exported.description.endswith(describe_adaptation(record))
        with torch.no_grad():
            torch.testing.assert_close(exported.embed_fn(x, lengths), expected, atol=1e-5, rtol=0)
    # the adapted state_dict export adapted again: the new statistics, said once
    again = audioclf.load(tmp_path / "w.pt")
    again.adapt(tmp_path / "new_source")
    assert again.loaded.description.count("adapted by") == 1
    assert again.adaptation["statistics"] == record["statistics"]
    # a plain export records no adaptation (its sidecar as before)
    plain = tmp_path / "plain.pt"
    assert (
        export_main(["--checkpoint", str(ckpt), "--format", "torchscript", "--out", str(plain)])
        == 0
    )
    assert "adaptation" not in json.loads(plain.with_name("plain.pt.json").read_text())
    assert audioclf.load(plain).adaptation is None


def write_wavs(folder, clips: list[torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, clip in enumerate(clips):
        soundfile.write(str(folder / f"clip{i}.wav"), clip.numpy(), 8000)


def test_model_adapt_records_what_it_did_and_changes_what_follows(tmp_path):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    write_wavs(tmp_path / "new_source", new_source_clips())
    write_wavs(tmp_path / "queries", new_source_clips(3, seed=5))
    model = audioclf.load(ckpt)
    _, before = model.embed(tmp_path / "queries")
    assert model.adaptation is None
    unadapted = model.loaded
    record = model.adapt(tmp_path / "new_source")
    assert record == model.adaptation
    assert record["method"] == "adabn" and record["clips"] == 5
    assert record["source"] == [str(tmp_path / "new_source")]
    assert model.loaded.description == unadapted.description + describe_adaptation(record)
    _, after = model.embed(tmp_path / "queries")
    assert np.abs(after - before).max() > 1e-3
    # the model it was adapted from is left as it was
    _, again = audioclf.Model(unadapted).embed(tmp_path / "queries")
    np.testing.assert_array_equal(again, before)
    # adapted again: from the new audio alone, said once
    model.adapt(tmp_path / "new_source")
    assert model.adaptation["statistics"] == record["statistics"]
    assert model.loaded.description.count("adapted") == 1
    # the same statistics as adapting the network on the clips read as evaluation reads them
    net, _, _ = load_trained(ckpt)
    adapt_batchnorm(net, [c.clamp(-1, 1) for c in new_source_clips()])
    for ours, theirs in zip(batchnorm_layers(net), batchnorm_layers(model.loaded.network)):
        torch.testing.assert_close(ours.running_mean, theirs.running_mean, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_an_export_cannot_be_adapted_one_line(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    out = tmp_path / "model.pt"
    assert (
        export_main(["--checkpoint", str(ckpt), "--format", "torchscript", "--out", str(out)]) == 0
    )
    write_wavs(tmp_path / "new_source", new_source_clips(2))
    with pytest.raises(
        ValueError,
        match="--adapt needs an audioclf checkpoint.*the checkpoint it was exported from",
    ):
        audioclf.load(out).adapt(tmp_path / "new_source")


@pytest.mark.parametrize(
    ("inputs", "said"),
    [
        ("", "got an empty path ('')"),
        ([], "got no files or folders"),
        (["a/", ""], "got an empty path ('')"),
    ],
)
def test_model_adapt_with_no_input_is_one_line_with_no_blank(tmp_path, monkeypatch, inputs, said):
    write_wavs(tmp_path / "cwd", new_source_clips(2))  # audio where '' would silently point
    monkeypatch.chdir(tmp_path / "cwd")
    model = audioclf.load(make_checkpoint(tmp_path / "best.pt", "cnn"))
    with pytest.raises(ValueError) as caught:
        model.adapt(inputs)
    message = str(caught.value)
    assert message.startswith(f"Model.adapt(inputs) {said}") and "\n" not in message, message
    assert message.endswith("pass the files or folders of unlabelled audio of the new source")
    assert "  " not in message and " ;" not in message and model.adaptation is None


def test_clips_of_one_length_are_measured_in_batches_as_they_were_one_by_one(tmp_path):
    # 9 clips of three lengths: each layer is measured in 6 batches of at most 2 clips of one
    # length (2 + 1 per length) instead of 9 single-clip passes; the statistics are those of the
    # clip-by-clip adaptation (to float rounding).
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    base = new_source_clips(3)
    clips = [c * scale for scale in (1.0, 0.5, 2.0) for c in base]
    assert [len(b) for b in same_length_batches(clips, 3)] == [3, 3, 3]
    one_by_one, _, _ = load_trained(ckpt)
    adapt_batchnorm(one_by_one, clips, batch_size=1)
    batched, _, _ = load_trained(ckpt)
    calls, embed = [], batched.embed

    def counted(x, lengths):
        calls.append(x.shape[0])
        assert (lengths == x.shape[1]).all()  # one length per batch: no padding
        return embed(x, lengths)

    batched.embed = counted
    adapt_batchnorm(batched, clips, batch_size=2)
    del batched.embed
    layers = batchnorm_layers(batched)
    assert sorted(calls) == sorted([2, 1, 2, 1, 2, 1] * len(layers))
    for ours, theirs in zip(layers, batchnorm_layers(one_by_one), strict=True):
        torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-4, atol=1e-6)
    # and both are what the adapted network then computes, clip by clip
    for layer, values in zip(layers, layer_inputs_loop(batched, clips), strict=True):
        np.testing.assert_allclose(layer.running_mean.numpy(), values.mean(axis=1), atol=1e-6)


def test_adaptation_measures_under_the_exact_arithmetic_of_embedding(tmp_path):
    # A training in the same process may leave TF32 on: the statistics were measured with it.
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    write_wavs(tmp_path / "new_source", new_source_clips())
    model = audioclf.load(ckpt)
    seen = []
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = tuple(f.allow_tf32 for f in flags)
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda _m, _args: seen.append(tuple(f.allow_tf32 for f in flags))
    )
    try:
        for f in flags:
            f.allow_tf32 = True
        model.adapt(tmp_path / "new_source")
        assert seen and set(seen) == {(False, False)}
        assert all(f.allow_tf32 for f in flags)  # put back after
    finally:
        hook.remove()
        for f, value in zip(flags, saved, strict=True):
            f.allow_tf32 = value


@pytest.mark.parametrize("tool", ["embed", "evaluate", "export"])
def test_an_empty_adapt_flag_is_one_line_and_not_the_working_folder(tool, tmp_path, capsys):
    # type=Path made '' into Path('.'): the CLI adapted on whatever audio the working folder held
    import importlib

    main = importlib.import_module(f"audioclf.{tool}").main
    with pytest.raises(SystemExit) as stopped:
        main(["--checkpoint", str(tmp_path / "best.pt"), "--adapt", "", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2
    assert err[-1].endswith(
        "argument --adapt: got an empty path (''); pass the files or folders of unlabelled audio "
        "of the new source"
    ), err
